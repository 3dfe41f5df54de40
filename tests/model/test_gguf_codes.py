"""A GGUF's Q8_0 / Q4_0 experts and dense projections held as their own codes (int8 in groups of 32 / int4), never
requantised.

The reference is built here from the `gguf` package alone: each block's values as `gguf.quants.dequantize` decodes
them, divided by the block's fp16 scale (its first two bytes, ggml's layout), are the codes; packed as moelane's
pools hold codes (pool.py's table), they make a `ResidentProvider` of the same model, and (`--quantize auto`) its
projections' kernel pools. moelane's loaded pools must be those tensors bit for bit, and its logits exactly the
reference's (same kernels, same codes): so what a Q8_0 / Q4_0 file runs is the file's own codes, through moelane's
int8 / int4 path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from torch import nn

import moelane
from moelane import kernels
from moelane.errors import ModelLoadError
from moelane.kernels.formats import QuantFormat
from moelane.kernels.pool import interleave
from moelane.model.gguf.codes import block_codes
from moelane.model.provider import ResidentProvider, TierPool, tier_pool
from moelane.pager.live.store import ExpertStore
from tests.gguf_helpers import write_gguf
from tests.helpers import check_pages_as_resident, random_model
from tests.kernels.helpers import code_like, sees_int8_codes
from tests.lanes.reference import prompts
from tests.lanes.test_engine_lm import check_identity, params_of
from tests.model.test_gguf_tiers import K_BLOCKS  # rows of 256: whole K-quant blocks

PROMPT = [1, 5, 9, 33, 2, 100, 7, 8, 44, 45, 46, 290, 13, 0]
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
             moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[])  # fmt: skip
KIND = {"Q8_0": "int8", "Q4_0": "int4"}


def codes_pool(values: np.ndarray, scales: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """values float32 [E, R, C] (each block of 32 a code times its scale), scales float16 [E, R, C / 32] -> a pool's
    (codes, scales) as pool.py lays them out."""
    n_experts, rows, cols = values.shape
    codes = np.rint(values.reshape(n_experts, rows, -1, 32) / scales[..., None].astype(np.float32))
    codes = codes.reshape(n_experts, rows, cols).astype(np.int16)
    if kind == "int8":
        return torch.from_numpy(codes.astype(np.int8)), torch.from_numpy(scales)
    nibbles = (codes + 8).astype(np.uint8)
    return torch.from_numpy(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)), torch.from_numpy(scales)


def reference_pools(path: Path, layers: list[int]) -> dict[int, TierPool]:
    """Every MoE layer's experts from the file's blocks, by the `gguf` package (module docstring)."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    pools = {}
    for layer in layers:
        parts = {}
        for name in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
            blocks = np.asarray(t.data)  # [E, R, bytes]
            _, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            values = gguf.quants.dequantize(blocks, t.tensor_type)
            scales = blocks.reshape(*blocks.shape[:2], -1, size)[..., :2].copy().view(np.float16)[..., 0]
            parts[name] = codes_pool(values, scales, KIND[t.tensor_type.name])
        kind = KIND[tensors[f"blk.{layer}.ffn_down_exps.weight"].tensor_type.name]
        w13 = tuple(torch.cat([g, u], dim=1).contiguous() for g, u in zip(parts["gate"], parts["up"], strict=True))
        hidden, width = parts["down"][1].shape[1], parts["gate"][1].shape[1]
        down = parts["down"]
        if kind == "int8":  # as the CPU's pools hold int8 (kernels/pool.py "interleaved")
            w13, down = interleave(w13[0], w13[1]), interleave(down[0], down[1])
        pools[layer] = tier_pool(0, kind, (w13[0], w13[1]), down, (hidden, width))
    return pools


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_blocks_repack_to_the_values_the_gguf_package_decodes(qtype: str) -> None:
    """Random blocks (every code, Q8_0's -128 and Q4_0's nibble 0 among them): the repacked pool dequantises to the
    `gguf` package's values exactly, and the kernels compute from it as from those values in float32."""
    rng = np.random.default_rng(0)
    kind, (block, size) = gguf.GGMLQuantizationType[qtype], gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows, cols = 24, 96
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    blocks[..., :2] = rng.uniform(0.001, 0.01, (rows, cols // block)).astype(np.float16).view(np.uint8).reshape(
        rows, -1, 2)  # fmt: skip
    blocks = blocks.reshape(rows, -1)
    fmt = QuantFormat(8, 32) if qtype == "Q8_0" else QuantFormat(4, 32)
    codes = np.empty((rows, cols * fmt.bits // 8), np.int8 if qtype == "Q8_0" else np.uint8)
    scales = np.empty((rows, cols // 32), np.float16)
    block_codes(blocks, qtype, codes, scales)
    pool = kernels.Pool(KIND[qtype], torch.from_numpy(codes)[None], torch.from_numpy(scales)[None], cols)
    want = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    assert pool.group == 32 and torch.equal(kernels.dequantize(pool)[0], want)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    seen = sees_int8_codes(x)  # (int8 and int4 products code their inputs: docs/kernels.md)
    exact = kernels.gather_linear(seen, None, None, kernels.Pool("f32", want[None].contiguous()))
    assert torch.allclose(kernels.gather_linear(x, None, None, pool), exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_experts_are_held_and_computed_as_the_files_codes(tmp_path: Path, qtype: str) -> None:
    """A Q8_0 (Q4_0) file's experts are all resident at int8 (int4) by default, in as many bytes as the file holds
    them; the pools are the reference's bit for bit and the logits exactly those of the reference provider;
    `default_tier="native"` decodes them."""
    folder = random_model("qwen3_moe", tmp_path / "hf", **SMALL)
    path = write_gguf(folder, tmp_path / "q.gguf", qtype)
    lm = moelane.load(path)
    assert isinstance(lm.provider, ResidentProvider) and lm.provider.kind == KIND[qtype]
    ref = reference_pools(path, lm.moe_layers)
    held = 0
    for layer in lm.moe_layers:
        (ours,) = lm.provider.pools(layer)
        for part, want in ((ours.w13, ref[layer].w13), (ours.w2, ref[layer].w2)):
            assert all(torch.equal(a, b) for a, b in zip(part, want, strict=True))  # type: ignore[arg-type]
            held += sum(t.numel() * t.element_size() for t in part if t is not None)
    assert held == sum(h.nbytes for hs in lm.expert_handles.values() for h in hs)
    with torch.no_grad():
        got = lm.logits(PROMPT)
        assert torch.equal(got, moelane.load(path, provider=lambda h, d: ResidentProvider(ref)).logits(PROMPT))
        native = moelane.load(path, default_tier="native")
        assert native.provider.kind == "native"
        want = native.logits(PROMPT)
        # (int8 and int4 experts code their inputs to 8 bits, docs/kernels.md; native ones do not)
        assert (got - want).abs().max().item() <= 5e-2 * want.abs().max().item()


@pytest.mark.parametrize(("qtype", "memory"), [("Q8_0", "13%"), ("Q4_0", "7%")])
def test_paged_codes_decode_as_all_resident(tmp_path: Path, qtype: str, memory: str) -> None:
    """The store at about half the experts' bytes at their codes' tier reads blocks from the file on each miss."""
    folder = random_model("qwen3_moe", tmp_path / "hf", **SMALL)
    check_pages_as_resident(write_gguf(folder, tmp_path / "q.gguf", qtype), PROMPT, expert_memory=memory)


@pytest.mark.parametrize("setting", [dict(qtype="Q4_0"), dict(qtype="Q8_0", expert_memory="13%")],
                         ids=["resident-q4_0", "paged-q8_0"])  # fmt: skip
def test_replies_equal_solo_decode_at_any_stream_count(tmp_path: Path, setting: dict[str, Any]) -> None:
    folder = random_model("qwen3_moe", tmp_path / "hf", **SMALL)
    lm = moelane.load(write_gguf(folder, tmp_path / "q.gguf", setting["qtype"]),
                      expert_memory=setting.get("expert_memory"))  # fmt: skip
    store = lm.provider
    if isinstance(store, ExpertStore):
        assert store.config.default_tier == 1 and store.tier_bytes[1] == lm.expert_handles[lm.moe_layers[0]][0].nbytes
    else:
        assert store.kind == KIND[setting["qtype"]]
    cases = [(p, list(lm.generate_ids(p, 12, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    for config in (dict(drafter="none", max_streams=6), dict(drafter="copy", max_streams=4, prefill_chunk=5)):
        check_identity(lm, None, cases, 12, **config)


def reference_projections(path: Path, lm: moelane.LM) -> dict[str, kernels.Pool]:
    """Every projection (`nn.Linear`) of a qwen3moe file whose tensor is Q8_0 / Q4_0, as a pool of the codes the
    `gguf` package decodes (module docstring), by module name."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, lm.args.num_hidden_layers)
    pools = {}
    for name in projections(lm):
        t = tensors[names.get_name(f"{name}.weight", try_suffixes=(".weight",))]
        if t.tensor_type.name not in KIND:
            continue
        blocks = np.asarray(t.data)  # [R, bytes]
        _, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        values = gguf.quants.dequantize(blocks, t.tensor_type)
        scales = blocks.reshape(blocks.shape[0], -1, size)[..., :2].copy().view(np.float16)[..., 0]
        codes, scale = codes_pool(values[None], scales[None], KIND[t.tensor_type.name])
        pools[name] = kernels.Pool(KIND[t.tensor_type.name], codes.contiguous(), scale.contiguous(), values.shape[1])
    return pools


def projections(lm: moelane.LM) -> dict[str, nn.Linear]:
    return {name: m for name, m in lm.model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_dense_projections_are_held_and_computed_as_the_files_codes(tmp_path: Path, qtype: str) -> None:
    """`quantize="auto"` (the default): every projection of a Q8_0 (Q4_0) file is an int8 (int4) pool equal bit for
    bit to the reference's, in the bytes the file holds it (~1/4, ~1/7 of float32); the logits are exactly those of
    the file loaded with `quantize="none"` whose projections are swapped for the reference's pools. `"int8"` keeps
    requantising the decoded values (its own groups of 64)."""
    folder = random_model("qwen3_moe", tmp_path / "hf", **SMALL)
    path = write_gguf(folder, tmp_path / "q.gguf", qtype)
    lm, reference = moelane.load(path), moelane.load(path, quantize="none")
    ref = reference_projections(path, lm)
    assert ref.keys() == projections(lm).keys()
    held = fp32 = 0
    for name, module in projections(lm).items():
        pool, want = module.weight, ref[name]
        assert isinstance(pool, kernels.Pool) and pool.kind == KIND[qtype]
        assert torch.equal(pool.data, want.data) and torch.equal(pool.scales, want.scales)  # type: ignore[arg-type]
        held += pool.data.numel() * pool.data.element_size() + pool.scales.numel() * 2  # type: ignore[union-attr]
        fp32 += pool.out_features * pool.in_features * 4  # type: ignore[operator]
        swapped = projections(reference)[name]
        del swapped.weight
        swapped.weight = want  # type: ignore[assignment]
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert held * 4 * block == fp32 * size  # (Q8_0: 34 bytes for 32 weights, Q4_0: 18)
    assert isinstance(lm.model.model.embed_tokens.weight, torch.Tensor)  # (embeddings decoded)
    with torch.no_grad():
        assert torch.equal(lm.logits(PROMPT), reference.logits(PROMPT))
    requantised = projections(moelane.load(path, quantize="int8"))["lm_head"].weight
    assert isinstance(requantised, kernels.Pool) and requantised.group == 64


TIED = dict(tie_word_embeddings=True)


@pytest.mark.parametrize(("family", "qtype", "overrides"), [("mixtral", "Q4_0", {}), ("qwen3_moe", "Q8_0", TIED)],
                         ids=["llama-rows", "tied-head"])  # fmt: skip
def test_projection_codes_hold_the_decoded_weights(tmp_path: Path, family: str, qtype: str, overrides: dict[str, Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A Llama file's q and k rows (permuted by the converter) and a tied LM head (from the embeddings' codes): each
    projection's pool holds exactly the weights `quantize="none"` decodes."""
    over = {**SMALL, "intermediate_size": 32} if family == "mixtral" else SMALL
    path = write_gguf(random_model(family, tmp_path / "hf", **over, **overrides), tmp_path / "q.gguf", qtype)
    lm, decoded = moelane.load(path), moelane.load(path, quantize="none")
    code_like(decoded.model, lm.model, monkeypatch)
    pairs = [(module.weight, projections(decoded)[name].weight) for name, module in projections(lm).items()]
    for pool, weight in pairs:
        want = weight.data[0] if isinstance(weight, kernels.Pool) else weight
        assert isinstance(pool, kernels.Pool) and pool.kind == KIND[qtype]
        assert torch.equal(kernels.dequantize(pool)[0], want)
    with torch.no_grad():
        want = decoded.logits(PROMPT)
        assert (lm.logits(PROMPT) - want).abs().max().item() <= 1e-2 * want.abs().max().item()  # (test_gguf.py)


def test_auto_decodes_the_projections_where_only_the_fallback_serves(tmp_path: Path) -> None:
    """The kernels' PyTorch fallback would compute the pools far slower than `F.linear` the decoded weights."""
    path = write_gguf(random_model("qwen3_moe", tmp_path / "hf", **SMALL), tmp_path / "q.gguf", "Q8_0")
    kernels.use_fallback(True)
    try:
        lm = moelane.load(path)
    finally:
        kernels.use_fallback(False)
    assert all(isinstance(m.weight, torch.Tensor) for m in projections(lm).values())


def test_an_unknown_quantize_is_one_line(tmp_path: Path) -> None:
    path = write_gguf(random_model("qwen3_moe", tmp_path / "hf", **SMALL), tmp_path / "q.gguf", "Q8_0")
    with pytest.raises(ModelLoadError, match="quantize must be one of auto, none, int8, int4, got 'int3'"):
        moelane.load(path, quantize="int3")


@pytest.mark.parametrize(("qtype", "kind"), [("Q6_K", "int8"), ("Q4_K", "int4")])
def test_other_block_projections_are_held_at_their_nearest_tier(tmp_path: Path, qtype: str, kind: str) -> None:
    """`quantize="auto"`: a projection of a block type with no codes of moelane's (a K-quant: llama.cpp's Q4_0 files
    hold the LM head at Q6_K) is a pool at its nearest tier, the decoded values quantised as `quantize=kind`
    quantises them (the LM head too, at the file's choice), bit for bit, never a float matrix; the logits are exactly
    those of the decoded load whose projections are swapped for those pools."""
    path = write_gguf(random_model("qwen3_moe", tmp_path / "hf", **K_BLOCKS), tmp_path / "k.gguf", qtype)
    lm, decoded = moelane.load(path), moelane.load(path, quantize="none")
    theirs = projections(decoded)
    assert "lm_head" in theirs and any("q_proj" in name for name in theirs)
    for name, module in projections(lm).items():
        pool, weight = module.weight, theirs[name].weight
        values = weight.data.float()  # (a float Pool's [1, Out, In], or a Parameter's [Out, In])
        want = kernels.quantize(values.reshape(1, *values.shape[-2:]), kind)
        assert isinstance(pool, kernels.Pool) and pool.kind == kind
        assert torch.equal(pool.data, want.data) and torch.equal(pool.scales, want.scales)  # type: ignore[arg-type]
        del theirs[name].weight
        theirs[name].weight = want  # type: ignore[assignment]
    with torch.no_grad():
        assert torch.equal(lm.logits(PROMPT), decoded.logits(PROMPT))
