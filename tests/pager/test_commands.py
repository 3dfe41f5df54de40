from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import moelane.commands.trace as trace_commands
from moelane.commands import common, main
from moelane.commands.trace import AHEAD_POLICIES, SWEEP_POLICIES, add_parser
from moelane.errors import MoelaneError
from moelane.model.checkpoint import ExpertHandle, TensorRef
from moelane.model.provider import RoutingRecord
from moelane.pager.live.memory import format_bytes
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


def test_every_policy_of_the_sweep_plot_looks_different(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twelve policies a sweep of a trace with the look-ahead replays, drawn: no two lines alike (lru and
    planner+ahead were the same blue), and the axes say their units."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from moelane.pager.lab.plots import plot_sweep

    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    policies = SWEEP_POLICIES + AHEAD_POLICIES
    rows = [{"policy": p, "fraction": f, "decode_hit_rate": f * (1 + i / 20), "tok_s_aggregate": 100 * f + i}
            for i, p in enumerate(policies) for f in (0.25, 0.5)]  # fmt: skip
    out = tmp_path / "sweep.png"
    plot_sweep(rows, str(out))
    assert out.stat().st_size > 0
    hit_rate, speed = figures[0].axes
    looks = [(line.get_color(), line.get_linestyle(), line.get_marker(), str(line.get_markerfacecolor()))
             for line in hit_rate.get_lines()]  # fmt: skip
    assert len(looks) == len(policies) == 12 and len(set(looks)) == 12
    assert "%" in hit_rate.get_xlabel() and "%" in hit_rate.get_ylabel() and "tokens/s" in speed.get_ylabel()


class Bar:
    """A progress bar that keeps its steps (for `monkeypatch.setattr(trace_commands, "progress", Bar)`)."""

    made: ClassVar[list[Bar]] = []

    def __init__(self, total: int, what: str, unit: str) -> None:
        self.total, self.unit, self.steps = total, unit, list[int]()
        Bar.made.append(self)

    def update(self, n: int) -> None:
        self.steps.append(n)

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def test_synth_shows_progress_by_tokens_and_ends_with_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.trc"
    argv = ["trace", "synth", "--out", str(out), "--requests", "2", "--prefill", "20", "--chunk", "8", "--decode", "5"]
    monkeypatch.setattr(common, "PROGRESS_DELAY_S", 0.0)  # (the bar as a terminal shows it, at once)
    assert main(argv) == 0
    t = read_trace(out)
    err = capsys.readouterr().err
    assert "writing:" in err and "0/50 [" in err and "tok/s" in err  # (tqdm's own text: done/total, rate)
    assert err.rstrip("\n").rsplit("\n", 1)[-1].rsplit("\r", 1)[-1] == (
        f"wrote {out}: 2 requests, {t.n_segments} segments, 50 tokens, {format_bytes(out.stat().st_size)}"
    )
    Bar.made.clear()
    monkeypatch.setattr(trace_commands, "progress", Bar)
    assert main(argv) == 0
    (bar,) = Bar.made
    assert bar.unit == "tok" and bar.steps == [8, 8, 4, 1, 1, 1, 1, 1] * 2 and sum(bar.steps) == bar.total


# A `trace synth` of some minutes, in a process of its own, as a terminal starts it (SIGINT handled: see
# tests/server/test_commands.py), stopped by the signal named in argv once it has written a segment.
SYNTH = """
import signal, sys
from moelane.commands import main

signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main(["trace", "synth", "--out", sys.argv[1], "--requests", "400", "--decode", "5000", "--layers", "4"]))
"""


@pytest.mark.parametrize(("signal_number", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigterm_stops_a_trace_command_as_ctrl_c_does(tmp_path: Path, signal_number: int, code: int) -> None:
    """Either signal: the segments written so far stay, readable, and one line says how many."""
    out = tmp_path / "s.trc"
    proc = subprocess.Popen([sys.executable, "-c", SYNTH, str(out)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.stat().st_size > 1000) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal_number)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    kept = read_trace(out).n_segments
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]  # (a progress bar redraws itself with \r)
    lines = [line for line in lines if line.strip()]
    assert proc.returncode == code and len(lines) == 1, err
    assert re.fullmatch(rf"WARNING \S+: writing stopped after \d+ of 400 requests: {out} keeps the "
                        rf"{kept} segments written so far", lines[0]), err  # fmt: skip
