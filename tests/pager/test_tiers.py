"""Precision tiers: group-wise int8/int4 against a brute-force reference, blob layout and sizes, the tier file
(built once, CRC-checked, rebuilt when the checkpoint changes), and a store serving every expert at int8/int4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import moelane
from moelane.kernels import formats
from moelane.kernels.formats import INT4_DIVISORS
from moelane.model.derived import cache_dir
from moelane.model.provider import ResidentProvider
from moelane.pager.live.build import store_factory
from moelane.pager.live.memory import parse_memory
from moelane.pager.live.storage import (
    FINITE_CHUNK,
    ExpertReadError,
    ShardFiles,
    TierFile,
    all_finite,
    decode_native,
    read_native,
)
from moelane.pager.live.store import ExpertStore
from moelane.pager.live.tiers import FORMATS, ExpertCodec, QuantFormat, dequantize, parse_tier, quantize
from tests.helpers import random_model


def reference_roundtrip(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Quantise and dequantise one group at a time, the slow obvious way."""
    out = np.zeros_like(w, dtype=np.float32)
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], group):
            chunk = np.zeros(group, dtype=np.float32)
            chunk[: w.shape[1] - g0] = w[r, g0 : g0 + group]
            coded = reference_int4(chunk) if bits == 4 else reference_int8(chunk)
            out[r, g0 : g0 + group] = coded[: w.shape[1] - g0]
    return out


def as_fp16_scale(scale: float) -> np.float32:
    scale = np.float32(np.float16(scale))
    return np.float32(1.0) if scale == 0 else scale


def reference_int8(chunk: np.ndarray) -> np.ndarray:
    scale = as_fp16_scale(np.abs(chunk).max() / 127)
    return np.clip(np.round(chunk / scale), -127, 127) * scale


def reference_int4(chunk: np.ndarray) -> np.ndarray:
    """Every divisor's scale and its codes' least-squares scale: the reconstruction of least squared error."""
    extreme = chunk[np.argmax(np.abs(chunk))]
    best, best_err = np.zeros_like(chunk), np.inf
    for divisor in INT4_DIVISORS:
        scale = as_fp16_scale(extreme / divisor)
        codes = np.clip(np.round(chunk / scale), -8, 7).astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            fitted = as_fp16_scale(np.float32((chunk * codes).sum() / (codes * codes).sum()))
        for s in (scale, fitted):
            err = ((chunk - codes * s) ** 2).sum()
            if err < best_err:
                best, best_err = codes * s, err
    return best


def rule_error(w: torch.Tensor, divisor: float, lo: int, hi: int) -> torch.Tensor:
    """Squared error per group [R, G] of w [R, G, group] coded with scale extreme / divisor, codes in [lo, hi]."""
    extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))
    scale = (extreme / divisor).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (w - torch.round(w / scale).clamp(lo, hi) * scale).square().sum(-1)


@pytest.mark.parametrize("tier", [1, 2])
@pytest.mark.parametrize("cols", [64, 100, 24, 96])
def test_roundtrip_matches_brute_force(tier: int, cols: int) -> None:
    fmt = FORMATS[tier]
    g = torch.Generator().manual_seed(tier * 1000 + cols)
    w = torch.randn(7, cols, generator=g) * 0.05
    w[3, :] = 0.0  # an all-zero row stays zero
    codes, scales = quantize(w, fmt)
    assert codes.dtype == torch.uint8 and codes.numel() == fmt.code_bytes(7, cols)
    assert scales.dtype == torch.float16 and scales.shape == (7, fmt.n_groups(cols))
    got = dequantize(codes, scales, cols, fmt)
    want = reference_roundtrip(w.numpy(), fmt.bits, fmt.group_for(cols))
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-7)
    assert torch.all(got[3] == 0)
    if fmt.bits == 8:  # rounding error is at most half a step of the group's scale
        step = scales.float().repeat_interleave(fmt.group_for(cols), dim=1)[:, :cols]
        assert torch.all((got - w).abs() <= step / 2 + 1e-6)


def test_int4_codes_no_group_worse_than_q4_0_or_a_symmetric_code() -> None:
    fmt = FORMATS[2]
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.02
    w[::3] *= torch.rand(256, generator=torch.Generator().manual_seed(6)) ** 4 * 10  # heavy-tailed rows too
    codes, scales = quantize(w, fmt)
    got = dequantize(codes, scales, 256, fmt).view(64, 8, 32)
    groups = w.view(64, 8, 32)
    err = (groups - got).square().sum(-1)
    q4_0, symmetric = rule_error(groups, -8.0, -8, 7), rule_error(groups, 7.0, -7, 7)
    assert torch.all(err <= q4_0 * (1 + 1e-5)) and torch.all(err <= symmetric * (1 + 1e-5))
    assert err.sum() < 0.95 * q4_0.sum() and err.sum() < 0.8 * symmetric.sum()


def test_int4_codes_use_the_whole_symmetric_range() -> None:
    fmt = FORMATS[2]
    w = torch.arange(-7, 8, dtype=torch.float32).repeat(1, 3)[:, :32]  # one group of 32 with every code
    codes, scales = quantize(w, fmt)
    assert torch.equal(dequantize(codes, scales, 32, fmt), w)


def test_blob_sizes_and_savings() -> None:
    # a Qwen3-30B-A3B-sized expert: hidden 2048, width 768, checkpoint bf16
    bf16_bytes = 3 * 2048 * 768 * 2
    int8, int4 = ExpertCodec(1, 768, 2048).nbytes, ExpertCodec(2, 768, 2048).nbytes
    assert int8 == 3 * 2048 * 768 * (1 + 2 / 64)
    assert int4 == 3 * 2048 * 768 * (0.5 + 2 / 32)
    assert 0.51 < int8 / bf16_bytes < 0.52 and 0.28 < int4 / bf16_bytes < 0.29
    assert FORMATS[1].group_for(96) == 32 and FORMATS[1].group_for(100) == 64 and FORMATS[2].group_for(48) == 16
    codec = ExpertCodec(2, 24, 48)
    w13, w2 = torch.randn(48, 48), torch.randn(48, 24)
    blob = codec.encode(w13, w2)
    out13, out2 = torch.empty(48, 48, dtype=torch.bfloat16), torch.empty(48, 24, dtype=torch.bfloat16)
    codec.decode_into(blob, out13, out2)
    fmt = codec.fmt
    assert torch.equal(out13, dequantize(*quantize(w13, fmt), 48, fmt).to(torch.bfloat16))
    assert torch.equal(out2, dequantize(*quantize(w2, fmt), 24, fmt).to(torch.bfloat16))


def test_parse_tier_and_bad_formats() -> None:
    assert [parse_tier(t) for t in ("0", "native", "int8", "INT4", 2)] == [0, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="unknown precision tier"):
        parse_tier("fp8")
    with pytest.raises(ValueError):
        QuantFormat(3, 32)
    with pytest.raises(ValueError):
        ExpertCodec(0, 8, 8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model("qwen3_moe", tmp_path_factory.mktemp("tiers"), seed=3)


def test_tier_file_is_built_once_checked_and_rebuilt_on_change(folder: Path, tmp_path: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(folder, model)
    lm = moelane.load(model)
    handles, files = lm.expert_handles, ShardFiles()
    hidden, width = next(iter(handles.values()))[0].tensors["down"].shape
    codec = ExpertCodec(1, width, hidden)
    tiers = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    assert tiers.path.parent == model / ".moelane"
    built = tiers.path.stat().st_mtime_ns
    handle = handles[lm.moe_layers[1]][4]
    w13, w2 = torch.empty(2 * width, hidden), torch.empty(hidden, width)
    decode_native(handle, read_native(files, handle), w13, w2)
    assert torch.equal(tiers.read(handle), codec.encode(w13, w2))
    tiers.close()
    again = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    assert again.path.stat().st_mtime_ns == built  # reused, not rebuilt
    again.close()
    index = again.path.with_suffix(".json")
    body = json.loads(index.read_text())
    assert body["quantizer"] == formats.QUANTIZER_VERSION
    del body["quantizer"]  # a file from before the quantiser's version was recorded: made by quantiser 3
    index.write_text(json.dumps(body))
    old = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    assert old.path.stat().st_mtime_ns == built or formats.QUANTIZER_VERSION != 3
    old.close()
    index.write_text(json.dumps({**body, "quantizer": formats.QUANTIZER_VERSION + 1}))  # another quantiser's codes
    newer = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    assert json.loads(index.read_text())["quantizer"] == formats.QUANTIZER_VERSION  # built again
    built = newer.path.stat().st_mtime_ns
    newer.close()
    again = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    assert again.path.stat().st_mtime_ns == built
    again.close()
    with open(again.path, "r+b") as f:  # damage one expert's blob
        f.seek(codec.nbytes * 5 + 3)
        f.write(b"\xff\xfe")
    damaged = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    with pytest.raises(ExpertReadError, match=r"expert 5 of layer 0: tier file .* corrupt"):
        damaged.read(handles[lm.moe_layers[0]][5])
    damaged.close()
    shard = next(model.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime: the fingerprint changes
    files.close()
    files = ShardFiles()  # the old descriptors rightly refuse a shard modified under them
    rebuilt = TierFile.open_or_build(handles, codec, cache_dir(model), files)
    assert rebuilt.read(handles[lm.moe_layers[0]][5]).numel() == codec.nbytes  # CRC fine again
    rebuilt.close()
    files.close()


@pytest.mark.parametrize(("tier", "tolerance", "share"), [("int8", 0.02, "30%"), ("int4", 0.3, "12%")])
def test_every_expert_at_a_lower_tier_resident_or_paged(
    folder: Path, tmp_path: Path, tier: str, tolerance: float, share: str
) -> None:
    """Every expert at int8 / int4: within the tier's rounding of the native logits. All resident at the tier where
    they fit (no budget); paged by a store at the tier under a budget that holds about 70% of them at it (in the
    compute dtype `share` holds 20%): the same logits bit for bit, a pair's result depending on its expert's codes
    and scales only, read from the tier file straight into the slots."""
    model = tmp_path / "m"
    shutil.copytree(folder, model)
    ids = list(range(3, 60))
    want = moelane.load(model).logits(ids)
    resident = moelane.load(model, default_tier=tier)
    assert isinstance(resident.provider, ResidentProvider) and resident.provider.kind == tier
    got = resident.logits(ids)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < tolerance
    lm = moelane.load(model, provider=store_factory(parse_memory(share), None, "planner", tier))
    store = lm.provider
    assert isinstance(store, ExpertStore)
    assert store.n_slots < store.table.slot_of.size <= 1.5 * store.n_slots
    assert torch.equal(lm.logits(ids), got)
    (level_tier,) = store.stats.bytes_read
    assert level_tier == ("disk", tier)
    assert {name for name, n in store.held_by_tier().items() if n} == {tier}
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_reads_the_exponent_bits_of_every_float_dtype(dtype: torch.dtype) -> None:
    w = torch.randn(48, 40).to(dtype)
    w[0, 0] = torch.finfo(dtype).max  # large but finite
    w[1, 1] = torch.finfo(dtype).tiny / 4  # subnormal
    w[2, 2] = -0.0
    assert all_finite(w) == bool(torch.isfinite(w).all())
    for bad in (float("inf"), float("-inf"), float("nan")):
        v = w.clone()
        v[47, 39] = bad
        assert not all_finite(v)
        assert all_finite(v[:47])
    big = torch.randn(3 * FINITE_CHUNK + 5).to(dtype)  # (chunks of the scratch, and a short last one)
    assert all_finite(big)
    for at in (0, FINITE_CHUNK - 1, FINITE_CHUNK, 2 * FINITE_CHUNK + 7, big.numel() - 1):
        v = big.clone()
        v[at] = float("nan")
        assert not all_finite(v), at


def test_the_shipped_models_tier_files_live_outside_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moelane.assets import default_model_path

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shipped = cache_dir(default_model_path())
    assert shipped.is_relative_to(tmp_path) and not (default_model_path() / ".moelane").exists()
    own = tmp_path / "model"
    own.mkdir()
    assert cache_dir(own) == own / ".moelane"
