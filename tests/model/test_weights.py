"""Dense projections through the kernels (`moelane.model.weights`): bf16 and quantised (int8, int4) weights become
kernel pools, hold exactly the quantised codes, give logits near the unquantised model's, keep every row's numbers
independent of the other rows of the pass, and compile with no graph break."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import moelane
from moelane import kernels
from moelane.errors import ModelLoadError
from moelane.model.cache import Rows
from moelane.model.weights import prepare_weights
from tests.helpers import random_model
from tests.kernels.helpers import code_like


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model("qwen3_moe", tmp_path_factory.mktemp("weights"))


def projections(lm: moelane.LM) -> list[nn.Linear]:
    return [m for m in lm.model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantised_projections_compute_as_the_model_with_their_dequantised_weights(
    folder: Path, quantize: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each projection holds its weight's tier codes and scales (the LM head int8 under int4 too, as a llama.cpp Q4_0
    file holds it), and the logits are those of the float32 model whose projections hold the dequantised weights
    and, where int8, see their inputs as int8 codes (the reference), within float32 rounding."""
    reference = moelane.load(folder)
    lm = moelane.load(folder, quantize=quantize)
    pairs = list(zip(projections(reference), projections(lm), strict=True))
    kinds = [quantize] * (len(pairs) - 1) + ["int8"]
    assert projections(lm)[-1] is lm.model.lm_head
    assert pairs and all(isinstance(q.weight, kernels.Pool) for _, q in pairs)
    assert [q.weight.kind for _, q in pairs] == kinds  # type: ignore[union-attr]
    with torch.no_grad():
        for (f, q), kind in zip(pairs, kinds, strict=True):
            weight = f.weight.data  # (the reference's f32 Pool [1, Out, In], or its Parameter's tensor [Out, In])
            want = kernels.quantize(weight.reshape(1, *weight.shape[-2:]), kind)
            assert torch.equal(q.weight.data, want.data) and torch.equal(q.weight.scales, want.scales)
            weight.copy_(kernels.dequantize(want).view_as(weight))
    code_like(reference.model, lm.model, monkeypatch)
    assert isinstance(lm.model.model.embed_tokens.weight, torch.Tensor)  # embeddings as stored
    ids = list(range(3, 40))
    want_logits, got = reference.logits(ids), lm.logits(ids)
    assert (got - want_logits).abs().max() <= 1e-4 * want_logits.abs().max()


@pytest.mark.skipif(kernels.ensure_built().backend == "fallback", reason="bf16 pools need the C++ kernels")
def test_bf16_projections_read_through_the_kernels_and_rows_stay_batch_invariant(folder: Path) -> None:
    lm = moelane.load(folder, torch.bfloat16)
    assert all(isinstance(m.weight, kernels.Pool) and m.weight.kind == "bf16" for m in projections(lm))
    a, b, extra = list(range(3, 40)), list(range(100, 120)), [5, 6, 7, 8]
    cache = lm.new_cache(256)
    solo = [lm.forward([Rows(cache, a, 0)])[0][-1]]
    solo += [lm.forward([Rows(cache, [t], 37 + i)])[0][0] for i, t in enumerate(extra)]
    ca, cb = lm.new_cache(256), lm.new_cache(256)
    lm.forward([Rows(ca, a[:13], 0), Rows(cb, b, 0)])
    last = lm.forward([Rows(cb, [3], 20), Rows(ca, a[13:], 13)])[1][-1:]
    drafted = lm.forward([Rows(ca, extra, 37), Rows(cb, [4, 5, 6], 21)])[0]
    assert torch.equal(torch.cat([last, drafted]), torch.stack(solo))


@pytest.mark.skipif(kernels.ensure_built().backend == "fallback", reason="pools need the C++ kernels")
@pytest.mark.parametrize(
    ("family", "dtype", "quantize", "compile"),
    [
        pytest.param("qwen3_moe", torch.float32, "int4", True, marks=pytest.mark.slow),
        ("qwen3_moe", torch.float32, "int4", False),
        ("qwen2_moe", torch.bfloat16, "none", False),
    ],
)
def test_q_k_and_v_in_one_product_give_the_bits_of_three(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, dtype: torch.dtype, quantize: str, compile: bool
) -> None:
    """Each attention's q, k and v pools are joined into one (qwen2_moe's biases added after it), its views take
    their place, and a prompt and decode steps (compiled in float32; in bf16 eager, since compiled bf16 drops
    roundings by the graph's fusions: `layers.linear_parts`) give the logits of the three products bit for bit."""
    folder = random_model(family, tmp_path / family)

    def run(lm: moelane.LM) -> torch.Tensor:
        cache = lm.new_cache(256)
        out = [lm.forward([Rows(cache, list(range(3, 20)), 0)])[0][-1]]
        return torch.stack(out + [lm.step(t, 17 + i, cache) for i, t in enumerate([5, 9, 11])])

    fused = moelane.load(folder, dtype, quantize=quantize, compile=compile)
    attentions = [m for m in fused.model.modules() if hasattr(m, "qkv")]
    assert attentions and all(isinstance(m.qkv, kernels.Pool) for m in attentions)
    for m in attentions:  # q, k and v view the joined pool's rows
        assert m.q_proj.weight.data.data_ptr() == m.qkv.data.data_ptr()
        assert m.v_proj.weight.data.untyped_storage().data_ptr() == m.qkv.data.untyped_storage().data_ptr()
    if family == "qwen2_moe":
        assert all(m.q_proj.bias is not None for m in attentions)
    monkeypatch.setattr("moelane.model.load.fuse_projections", lambda model: 0)
    apart = moelane.load(folder, dtype, quantize=quantize, compile=compile)
    assert all(m.qkv is None for m in apart.model.modules() if hasattr(m, "qkv"))
    assert torch.equal(run(fused), run(apart))


@pytest.mark.slow
def test_a_quantised_model_compiles_its_decode_step_whole(folder: Path) -> None:
    lm = moelane.load(folder, quantize="int8", compile=True)
    cache = lm.new_cache(256)
    lm.forward([Rows(cache, list(range(3, 20)), 0)])
    # torch.compile's step (the exported one's fallback, which it is traced from)
    explained = torch._dynamo.explain(getattr(lm._compiled, "compiled", lm._compiled))  # type: ignore[attr-defined]
    rows = torch.tensor([[5, 17, cache.slot]])
    keys = torch.arange(256)
    result = explained([(rows, cache.pool, keys)])
    assert result.graph_break_count == 0
    eager = moelane.load(folder, quantize="int8")
    want = eager.forward([Rows(eager.new_cache(256), [*range(3, 20), 5], 0)])[0][-1]
    got = lm.step(5, 17, cache)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_an_unknown_quantisation_is_refused(folder: Path) -> None:
    lm = moelane.load(folder)
    with pytest.raises(ModelLoadError, match="quantize must be one of auto, none, int8, int4"):
        prepare_weights(lm.model, "int3")


def test_quantised_projections_are_cached_beside_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first int4 load quantises the projections and keeps them (`derived.DenseCache`); the next takes the same
    codes from the file without quantising; a checkpoint rewritten, another compute dtype or a damaged file
    quantises again (and a damaged file is rewritten, not an error)."""
    folder = random_model("qwen3_moe", tmp_path / "m")
    calls = []
    quantize = kernels.quantize

    def counted(w: torch.Tensor, kind: str) -> kernels.Pool:
        calls.append(kind)
        return quantize(w, kind)

    monkeypatch.setattr(kernels, "quantize", counted)
    first = moelane.load(folder, quantize="int4")
    n = len(calls)
    assert n == len(projections(first)) and (folder / ".moelane" / "dense-int4-float32.safetensors").is_file()
    again = moelane.load(folder, quantize="int4")
    assert len(calls) == n
    for a, b in zip(projections(first), projections(again), strict=True):
        assert a.weight.kind == b.weight.kind  # type: ignore[union-attr]
        assert torch.equal(a.weight.data, b.weight.data) and torch.equal(a.weight.scales, b.weight.scales)  # type: ignore[union-attr]
    ids = list(range(3, 30))
    assert torch.equal(first.logits(ids), again.logits(ids))

    moelane.load(folder, torch.bfloat16, quantize="int4")  # another dtype: its own file
    assert len(calls) == 2 * n and (folder / ".moelane" / "dense-int4-bfloat16.safetensors").is_file()
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes())  # rewritten (a new mtime): quantised again
    moelane.load(folder, quantize="int4")
    assert len(calls) == 3 * n
    cached = folder / ".moelane" / "dense-int4-float32.safetensors"
    cached.write_bytes(cached.read_bytes()[: cached.stat().st_size // 2])
    damaged = moelane.load(folder, quantize="int4")
    assert len(calls) == 4 * n and torch.equal(damaged.logits(ids), first.logits(ids))
    moelane.load(folder, quantize="int4")
    assert len(calls) == 4 * n  # the damaged file was rewritten


def test_a_dense_cache_that_cannot_be_written_leaves_the_load_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (or any failed write) costs the cache, never the load, and leaves no partial file behind."""
    from safetensors import SafetensorError

    from moelane.model import derived

    def full(tensors: object, filename: str, metadata: object) -> None:
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("No space left on device")

    monkeypatch.setattr(derived, "save_file", full)
    folder = random_model("qwen3_moe", tmp_path / "m")
    lm = moelane.load(folder, quantize="int8")
    assert all(isinstance(m.weight, kernels.Pool) for m in projections(lm))
    assert list((folder / ".moelane").iterdir()) == []
