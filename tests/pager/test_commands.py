import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from moelane.commands.trace import add_parser
from moelane.errors import MoelaneError
from moelane.model.checkpoint import ExpertHandle, TensorRef
from moelane.model.provider import RoutingRecord
from moelane.pager.live.recorder import open_recorder
from moelane.pager.plan import Plan
from moelane.pager.trace import read_trace, write_trace

from .helpers import small_trace


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(argv)
    return int(args.func(args))


def test_analyze_and_replay_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.trc"
    write_trace(path, small_trace(0))
    assert run(["trace", "analyze", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["overall"]["n_decode_tokens"] == 40
    assert (
        run(["trace", "replay", str(path), "--fraction", "0.5", "--policy", "lru", "--policy", "belady", "--json"]) == 0
    )
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["policy"] for r in rows] == ["lru", "belady"]
    assert rows[1]["decode_hit_rate"] >= rows[0]["decode_hit_rate"]
    plan_file = tmp_path / "plan.json"
    assert (
        run(["trace", "replay", str(path), "--slots", "12", "--policy", "planner", "--plan-out", str(plan_file)]) == 0
    )
    assert Plan.from_json(plan_file.read_text()).budget_bytes == 12 * small_trace(0).header.expert_bytes
    capsys.readouterr()
    assert run(["trace", "replay", str(path), "--sweep", "--policy", "lru", "--policy", "planner"]) == 0
    assert "planner" in capsys.readouterr().out


def test_bad_input_raises_moelane_error(tmp_path: Path) -> None:
    with pytest.raises(MoelaneError):
        run(["trace", "analyze", str(tmp_path / "missing.trc")])
    path = tmp_path / "t.trc"
    write_trace(path, small_trace(0))
    with pytest.raises(MoelaneError):
        run(["trace", "replay", str(path), "--slots", "12", "--policy", "nope"])
    with pytest.raises(MoelaneError):
        run(["trace", "replay", str(path)])
    for size in (["--slots", "0"], ["--budget", "5"], ["--fraction", "5"], ["--fraction", "0"]):
        with pytest.raises(MoelaneError, match=r"holds no expert|must be"):
            run(["trace", "replay", str(path), *size])


class FakeLM:
    def __init__(self) -> None:
        self.moe_layers = [1, 3]
        self.args = argparse.Namespace(num_experts=6, num_experts_per_tok=2)
        gate_up, down = TensorRef("none", 0, 64, "BF16", (4, 8)), TensorRef("none", 64, 32, "BF16", (8, 2))  # H 8, I 2
        handle = ExpertHandle(0, 0, {"gate_up": gate_up, "down": down})
        self.expert_handles = {1: [handle] * 6, 3: [handle] * 6}
        self.observers: list[Any] = []

    def forward(self, ids: torch.Tensor, phase: str) -> None:  # ids [L, T, K]
        for o in self.observers:
            o.observe(RoutingRecord(ids, torch.rand(ids.shape), phase, ()))


def test_recorder_writes_one_segment_per_pass(tmp_path: Path) -> None:
    lm = FakeLM()
    path = tmp_path / "r.trc"
    passes = [torch.randint(0, 6, (2, 5, 2)), torch.randint(0, 6, (2, 1, 2))]
    with open_recorder(path, lm, lookahead=False) as rec:  # a fake with no model to hook
        rec.stream = 7
        lm.forward(passes[0], "prefill")
        lm.forward(passes[1], "decode")
    assert lm.observers == []
    t = read_trace(path)
    assert t.header.n_layers == 2 and t.header.moe_layers == (1, 3) and t.header.tiers[0] == ("bf16", 96)
    assert t.seg_phase == ("prefill", "decode")
    assert np.array_equal(t.expert_ids, torch.cat(passes, dim=1).permute(1, 0, 2).numpy())
    assert set(t.stream_ids.tolist()) == {7}


def test_plot_needs_matplotlib_or_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "t.trc"
    write_trace(path, small_trace(0))
    out = tmp_path / "sweep.png"
    argv = ["trace", "replay", str(path), "--sweep", "--policy", "lru", "--plot", str(out), "--json"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(MoelaneError):
            run(argv)
        return
    assert run(argv) == 0 and out.stat().st_size > 0
