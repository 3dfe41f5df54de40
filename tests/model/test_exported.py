"""The decode step compiled ahead of time (`moelane.model.exported`): batch-invariant rows at every precision, the
model's own weights (nothing copied), the cache of compiled libraries, and torch.compile where export fails."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import moelane
from moelane.model import exported
from moelane.model.cache import Rows
from moelane.model.exported import AheadOrCompiled, ExportedStep
from tests.helpers import random_model

# The whole file is in the slow set: a library takes ~10 s to compile, and a fresh machine's first ~20 s (Inductor
# first probes the CPU's vector ISAs), more than the fast set's 3 minutes can hold.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model("qwen3_moe", tmp_path_factory.mktemp("q3"))


PROMPT = list(range(3, 30))
FED = {0: [11, 12, 13, 15], 1: [14], 2: [16, 17, 18]}  # each stream's generated tokens (stream 2 in a larger pool)


def shared(lm: moelane.LM, pools: int = 1) -> list[torch.Tensor]:
    """Each stream's generated rows' logits through the step, stream 0 alone, then beside the others' rows, drafts
    included: of its own pool, and at `pools` 2 of another pool too (stream 2's, a call reading two pools)."""
    caches = [lm.new_cache(256), lm.new_cache(256), lm.new_cache(512 if pools == 2 else 256)]
    for cache in caches:
        lm.forward([Rows(cache, PROMPT, 0)])
    n = len(PROMPT)
    a = lm.forward([Rows(caches[0], [11], n, decode=True)])
    b = lm.forward([Rows(caches[0], [12, 13], n + 1, decode=True), Rows(caches[1], [14], n, decode=True)])
    c = lm.forward([Rows(caches[0], [15], n + 3, decode=True), Rows(caches[2], [16, 17, 18], n, decode=True)])
    return [torch.cat([a[0], b[0], c[0]]), b[1], c[1]]


def solo(lm: moelane.LM, pools: int = 1) -> list[torch.Tensor]:
    """The same streams decoded alone, one token a step."""
    out = []
    for stream, tokens in FED.items():
        cache = lm.new_cache(512 if stream == 2 and pools == 2 else 256)
        lm.forward([Rows(cache, PROMPT, 0)])
        out.append(torch.stack([lm.step(t, len(PROMPT) + i, cache) for i, t in enumerate(tokens)]))
    return out


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def exported_of(lm: moelane.LM) -> ExportedStep | None:
    assert isinstance(lm._compiled, AheadOrCompiled)
    return lm._compiled.exported


def eager_shared(folder: Path, quantize: str, pools: int = 1) -> list[torch.Tensor]:
    return shared(moelane.load(folder, quantize=quantize), pools)


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Within float32 rounding: the eager pass's matrix kernels order their sums otherwise."""
    return all(torch.allclose(x, y, rtol=0, atol=1e-4) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("quantize", "pools"), [("int4", 1), ("int4", 2), ("none", 2), ("int8", 2)])
def test_exported_rows_do_not_depend_on_what_shares_the_call(folder: Path, quantize: str, pools: int) -> None:
    """At float32 and with int8 / int4 weights, each stream's rows through the exported step are the bits of its
    one-token steps alone, among other streams' rows of one pool and of two, drafts included; they are the eager
    pass's logits within float32 rounding."""
    ahead = moelane.load(folder, quantize=quantize, compile=True)
    got = shared(ahead, pools)
    exported = exported_of(ahead)
    assert exported is not None  # (no fallback)
    assert sorted(n for n, _ in exported._runners) == list(range(1, pools + 1))
    assert same_bits(got, solo(ahead, pools))
    assert close(got, eager_shared(folder, quantize, pools))


def test_the_library_reads_the_models_own_weights(folder: Path) -> None:
    """The library holds no copy of the weights: weights changed in place (a norm's parameter; the experts of a
    layer's pool, rotated) change the next step's logits as they change the eager pass's."""
    ahead, eager = moelane.load(folder, quantize="int4", compile=True), moelane.load(folder, quantize="int4")
    before = shared(ahead)
    for lm in (ahead, eager):
        with torch.no_grad():
            dict(lm.model.named_parameters())["model.norm.weight"].mul_(1.5)
            codes = lm.provider.pools(lm.moe_layers[0])[0].w13[0]
            codes.copy_(codes.roll(1, 0))
    after = shared(ahead)
    assert not torch.equal(after[0], before[0])
    assert close(after, shared(eager))


def test_a_second_load_reads_the_library_from_the_cache(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled library is cached by graph, shapes, torch and threads: a second load of the model compiles
    nothing and gives the same bits."""
    want = shared(moelane.load(folder, quantize="int4", compile=True))

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    used: list[Path] = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compile)
    monkeypatch.setattr(exported, "touch", used.append)
    second = moelane.load(folder, quantize="int4", compile=True)
    got = shared(second)
    assert exported_of(second) is not None
    assert same_bits(got, want)
    assert used and all(p.parent.name == "steps" and p.is_file() for p in used)  # marked as used for `prune`


def test_where_export_fails_the_step_runs_through_torch_compile(
    folder: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An export that fails costs one warning line: every step then runs through torch.compile."""

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("unsupported operator\nmore detail")

    monkeypatch.setattr(torch.export, "export", fails)
    lm = moelane.load(folder, compile=True)
    assert isinstance(lm._compiled, AheadOrCompiled)
    calls: list[int] = []
    step = lm._compiled.compiled
    lm._compiled.compiled = lambda parts: calls.append(len(parts)) or step(parts)
    with caplog.at_level(logging.WARNING, logger="moelane"):
        got = shared(lm, 2)
    assert exported_of(lm) is None and calls == [1, 1, 2]  # (pools a call read)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert lines == ["compiling the decode step ahead of time failed (unsupported operator); using torch.compile"]
    assert close(got, eager_shared(folder, "none", 2))


def test_the_environment_can_choose_torch_compile(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOELANE_STEP", "dynamo")
    lm = moelane.load(folder, compile=True)
    assert lm.compile_enabled and not isinstance(lm._compiled, AheadOrCompiled)
