"""A distributed run's replies are token-identical to one process's, its logits bit-identical: ranks of spawned
processes on this machine (gloo over 127.0.0.1), against `moelane.load` in this process. Fast: 2 ranks on a tiny
random qwen3_moe, one of them paging its share, with contiguous and balanced placements. Slow: 3 ranks; the shipped
model at 1, 4 and 8 streams with every expert resident and at a 25% budget per rank; every MoE family's logits
(shared experts, expert biases, inputs scaled by their weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moelane
from moelane.pager.trace import TraceHeader, TraceWriter
from tests.distributed.helpers import Logits, Rank, Replies, launch, replies
from tests.helpers import FAMILY_CONFIGS, random_model
from tests.lanes.reference import prompts

CONFIGS = [dict(drafter="none", max_streams=1, timed=False), dict(drafter="copy", max_streams=4, timed=False)]


def check(path: Path | None, ranks: list[Rank], cases: list[list[int]], n_tokens: int,
          configs: list[dict[str, Any]]) -> None:  # fmt: skip
    got = launch(path, Replies(cases, n_tokens, configs), ranks)
    assert not (isinstance(got, tuple) and got[0] == "error"), got
    logits, spread = got
    lm = moelane.load(path)
    for case, theirs in zip(cases, logits, strict=True):
        assert torch.equal(theirs, lm.logits(case)), f"logits of {case}"
    want = replies(lm, cases, n_tokens, configs)
    for config, theirs, ours in zip(configs, spread, want, strict=True):
        assert theirs == ours, config
    assert any(len(reply) > 1 for reply in want[0])


@pytest.mark.slow  # (~4 s; the fast set keeps the balanced placement's two ranks)
def test_two_ranks_reply_as_one_process(tiny: Path) -> None:
    """Greedy and seeded (alternate prompts), drafters none and copy at 1 and 4 streams; rank 1 pages its share."""
    cases = prompts(4, 300)
    check(tiny, [Rank(), Rank({"expert_memory": "50%"})], cases, 10, CONFIGS)


def skewed_trace(path: Path, moe_layers: list[int], n_experts: int, top_k: int) -> Path:
    """A trace of the tiny model whose routing favours the low expert ids, which contiguous ranges give rank 0."""
    header = TraceHeader(len(moe_layers), n_experts, top_k, (("f32", 1),), tuple(moe_layers))
    g = np.random.default_rng(0)
    ids = np.stack([np.stack([g.choice(n_experts, top_k, replace=False, p=np.arange(n_experts, 0, -1) /
                                        (n_experts * (n_experts + 1) / 2)) for _ in moe_layers])
                    for _ in range(64)]).astype(np.uint8)  # fmt: skip
    with TraceWriter(path, header) as w:
        w.write_segment(ids, np.ones(ids.shape, np.float32), "decode")
    return path


class WithPlacement(Replies):
    """`Replies`, and the run's placement."""

    def __call__(self, lm: Any) -> Any:
        return super().__call__(lm), lm.provider.placement


def test_two_ranks_reply_as_one_process_under_a_balanced_placement(tiny: Path, tmp_path: Path) -> None:
    lm = moelane.load(tiny)
    args = lm.args
    trace = skewed_trace(tmp_path / "skewed.trc", list(lm.moe_layers), args.num_experts, args.num_experts_per_tok)
    cases = prompts(3, 300)
    settings = {"placement_trace": trace}
    got = launch(tiny, WithPlacement(cases, 8, CONFIGS[:1]), [Rank(settings), Rank({"expert_memory": "50%"})])
    assert not (isinstance(got, tuple) and got[0] == "error"), got
    (logits, spread), placement = got
    assert placement.kind == "balanced" and placement.experts(lm.moe_layers[0], 0) != [0, 1, 2, 3, 4]
    for case, theirs in zip(cases, logits, strict=True):
        assert torch.equal(theirs, lm.logits(case)), f"logits of {case}"
    assert spread == replies(lm, cases, 8, CONFIGS[:1])


@pytest.mark.slow
def test_three_ranks_reply_as_one_process(tiny: Path) -> None:
    check(tiny, [Rank({"expert_memory": "50%"}), Rank(), Rank({"expert_memory": "60%"})], prompts(6, 300), 12,
          CONFIGS)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, "25%"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_shipped_model_replies_as_one_process(budget: str | None, world: int) -> None:
    lm = moelane.load()
    cases = [lm.tokenizer.encode(text) for text in ("Once upon a time", "The quick brown fox", "def add(a, b):",
                                                    "To be, or not to be", "1, 2, 3, 4,", "Hello, my name is",
                                                    "In the beginning", "Roses are red")]  # fmt: skip
    configs = [dict(drafter=drafter, max_streams=streams, timed=False) for streams in (1, 4, 8)
               for drafter in ("none", "copy")]  # fmt: skip
    check(None, [Rank({"expert_memory": budget})] * world, cases, 24, configs)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILY_CONFIGS if f not in ("qwen3", "llama")])
def test_every_family_computes_as_one_process(tmp_path: Path, family: str) -> None:
    folder = random_model(family, tmp_path / family)
    cases = [[1, 5, 9, 13, 2, 7], [4, 4, 4, 8]]
    got = launch(folder, Logits(cases), [Rank(), Rank(), Rank()])
    assert not (isinstance(got, tuple) and got[0] == "error"), got
    lm = moelane.load(folder)
    assert all(torch.equal(theirs, lm.logits(case)) for theirs, case in zip(got, cases, strict=True))
