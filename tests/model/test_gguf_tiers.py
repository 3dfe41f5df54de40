"""A GGUF's K-quant experts (and other block types with no map to moelane's formats) held at the nearest tier, their
values requantised once into a tier file beside the GGUF and paged from there.

The reference is built here from the `gguf` package and moelane's quantiser alone: each expert's blocks decoded by
`gguf.quants.dequantize`, gate and up stacked, then quantised at the tier's format by `kernels.formats.quantize` (what
`tiers.ExpertCodec` writes), make a `ResidentProvider` of the same model. moelane's pools must be those tensors bit
for bit and its logits exactly that provider's, loaded again from the tier file (not rebuilt), and paged from it.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import moelane
from moelane.errors import ModelLoadError
from moelane.kernels.formats import FORMATS, quantize
from moelane.kernels.pool import interleave
from moelane.model.checkpoint import ExpertHandle, TensorRef
from moelane.model.gguf.blocks import byte_shape
from moelane.model.provider import ResidentProvider, TierPool, tier_pool
from moelane.pager.live.store import ExpertStore
from moelane.pager.live.tiers import TIER_NAMES, default_tier
from tests.gguf_helpers import write_gguf
from tests.helpers import random_model

PROMPT = [1, 5, 9, 33, 2, 100, 7, 8, 44, 45, 46, 290, 13, 0]
# K-quant blocks hold 256 values: rows of 256; every layer with experts, as llama.cpp runs Qwen3-MoE
K_BLOCKS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, moe_intermediate_size=256,
                num_experts=4, num_hidden_layers=2, mlp_only_layers=[])  # fmt: skip
# (tier, a budget holding about half the experts at it: int4 takes ~14% of the float32 bytes, int8 in groups of 64 ~26%)
NEAREST = {"Q4_K": (2, "7%"), "Q6_K": (1, "13%")}


def reference_pools(path: Path, layers: list[int], tier: int) -> dict[int, TierPool]:
    """Every MoE layer's experts from the file's blocks, decoded by the `gguf` package and quantised by moelane's
    quantiser (module docstring)."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    fmt, code_dtype = FORMATS[tier], torch.int8 if tier == 1 else torch.uint8
    pools = {}
    for layer in layers:
        gate, up, down = (stacked_values(tensors[f"blk.{layer}.ffn_{n}_exps.weight"]) for n in ("gate", "up", "down"))
        parts = []
        for matrices in ([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)], list(down)):
            codes, scales = zip(*(quantize(w, fmt) for w in matrices), strict=True)
            rows = matrices[0].shape[0]
            data, stacked = torch.stack([c.view(rows, -1) for c in codes]).view(code_dtype), torch.stack(scales)
            parts.append(interleave(data, stacked) if tier == 1 else (data, stacked))  # (the CPU's int8: pool.py)
        dims = (gate.shape[2], gate.shape[1])  # (H, I)
        pools[layer] = tier_pool(0, TIER_NAMES[tier], parts[0], parts[1], dims)
    return pools


def stacked_values(t: gguf.ReaderTensor) -> torch.Tensor:
    """A stacked expert tensor's values [E, rows, cols], float32, as the `gguf` package decodes its blocks."""
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)))


# Q4_K (int4's least-squares scales over every expert: ~10 s) runs with the slow set; Q6_K keeps the path fast
@pytest.mark.parametrize("qtype", [pytest.param("Q4_K", marks=pytest.mark.slow), "Q6_K"])
def test_k_quant_experts_are_requantised_once_to_the_nearest_tier(tmp_path: Path, qtype: str) -> None:
    """Q4_K experts at int4, Q6_K ones at int8 by default: all resident, the pools the reference's bit for bit and
    the logits exactly its provider's; the tier file is written once beside the GGUF, under its name, and read (not
    rewritten) by a second load and by the pager at about half the experts, whose logits are the resident ones."""
    tier, half = NEAREST[qtype]
    folder = random_model("qwen3_moe", tmp_path / "hf", **K_BLOCKS)
    (tmp_path / "k").mkdir()
    path = write_gguf(folder, tmp_path / "k" / "m.gguf", qtype)
    lm = moelane.load(path)
    assert isinstance(lm.provider, ResidentProvider) and lm.provider.kind == TIER_NAMES[tier]
    cache = tmp_path / "k" / ".moelane" / f"m.experts-{TIER_NAMES[tier]}.bin"
    written = cache.stat().st_mtime_ns
    ref = reference_pools(path, lm.moe_layers, tier)
    for layer in lm.moe_layers:
        (ours,) = lm.provider.pools(layer)
        for part, want in ((ours.w13, ref[layer].w13), (ours.w2, ref[layer].w2)):
            assert all(torch.equal(a, b) for a, b in zip(part, want, strict=True))  # type: ignore[arg-type]
    with torch.no_grad():
        got = lm.logits(PROMPT)
        assert torch.equal(got, moelane.load(path, provider=lambda h, d: ResidentProvider(ref)).logits(PROMPT))
        assert torch.equal(moelane.load(path).logits(PROMPT), got)
        paged = moelane.load(path, expert_memory=half)
        store = paged.provider
        assert isinstance(store, ExpertStore) and store.config.default_tier == tier
        assert store.n_slots < sum(len(hs) for hs in paged.expert_handles.values())
        assert torch.equal(paged.logits(PROMPT), got)
        assert store.stats.totals().misses > 0
        paged.close()
    assert cache.stat().st_mtime_ns == written


@pytest.mark.parametrize("expert_memory", [None, "7%"], ids=["resident", "paged"])
def test_no_place_for_the_tier_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                expert_memory: str | None) -> None:  # fmt: skip
    """Neither the GGUF's folder nor the cache can take the tier file (a plain file stands where each folder would
    be): one ModelLoadError at load, resident or paged."""
    path = write_gguf(random_model("qwen3_moe", tmp_path / "hf", **K_BLOCKS), tmp_path / "m.gguf", "Q4_K")
    (tmp_path / ".moelane").write_text("")
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match=r"^cannot build the int4 tier file of .*--default-tier native"):
        moelane.load(path, expert_memory=expert_memory)


def recording_bars(made: list[list]) -> type:
    """A stand-in for tqdm that appends every bar made to `made` as [description, total, steps taken, shown]."""

    class Bar:
        def __init__(self, *_: object, total: int, desc: str, disable: bool = False, **__: object) -> None:
            self.row = [desc, total, 0, not disable]
            made.append(self.row)

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def update(self, n: int = 1) -> None:
            self.row[2] += n

    return Bar


# (paged: with the slow set, for the fast loop's 3 minutes: the longest fast test when the machine is loaded)
@pytest.mark.parametrize("expert_memory", [None, pytest.param("7%", marks=pytest.mark.slow)], ids=["resident", "paged"])
def test_building_the_tier_file_shows_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               expert_memory: str | None) -> None:  # fmt: skip
    """With `progress`, building the tier file moves a bar by every expert, resident or paged, as loading the
    experts does; a load that finds the file builds nothing, and without `progress` no bar is shown."""
    path = write_gguf(random_model("qwen3_moe", tmp_path / "hf", **K_BLOCKS), tmp_path / "m.gguf", "Q4_K")
    made: list[list] = []
    monkeypatch.setattr("tqdm.tqdm", recording_bars(made))
    lm = moelane.load(path, expert_memory=expert_memory, progress=True)
    n_experts = sum(len(hs) for hs in lm.expert_handles.values())
    lm.close()
    built = [row for row in made if "tier file" in row[0]]
    assert built == [["building the int4 tier file", n_experts, n_experts, True]]
    made.clear()
    moelane.load(path, expert_memory=expert_memory, progress=True).close()
    assert not [row for row in made if "tier file" in row[0]]
    (tmp_path / ".moelane" / "m.experts-int4.bin").unlink()
    moelane.load(path, expert_memory=expert_memory).close()
    assert [row[3] for row in made if "tier file" in row[0]] == [False]


def handles_of(kinds: dict[str, str], n_layers: int = 2) -> dict[int, list[ExpertHandle]]:
    """Two experts a layer whose gate, up and down tensors (256 x 256 each) are of these GGML types (no file)."""
    out = {}
    for layer in range(n_layers):
        refs = {name: TensorRef("m.gguf", 0, 1, kind, byte_shape((256, 256), kind)) for name, kind in kinds.items()}
        out[layer] = [ExpertHandle(layer, e, refs, "gguf") for e in range(2)]
    return out


@pytest.mark.parametrize(("kinds", "tier"), [
    (dict(gate="Q4_K", up="Q4_K", down="Q6_K"), 2),  # llama.cpp's Q4_K_M: most weights 4-bit
    (dict(gate="Q5_K", up="Q5_K", down="Q6_K"), 1),  # Q5_K_M
    (dict(gate="Q3_K", up="Q3_K", down="Q5_K"), 2),  # Q3_K_M
    (dict(gate="Q5_0", up="Q5_1", down="Q4_1"), 1),
    (dict(gate="IQ4_XS", up="IQ4_XS", down="IQ4_XS"), 2),
    (dict(gate="Q4_K", up="Q4_K", down="F16"), 0),  # a float tensor: native
    (dict(gate="MXFP4", up="MXFP4", down="MXFP4"), 0),
], ids=["q4_k_m", "q5_k_m", "q3_k_m", "q5-q4_1", "iq4_xs", "with-f16", "mxfp4"])  # fmt: skip
def test_auto_takes_the_tier_nearest_most_of_the_weights(kinds: dict[str, str], tier: int) -> None:
    assert default_tier("auto", handles_of(kinds)) == tier
    assert default_tier("native", handles_of(kinds)) == 0
