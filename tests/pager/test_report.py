"""`moelane trace analyze --html`: a recorded trace as the dashboard's pager views, the same object as the server's
`/v1/stats` (validated against its schema), replayed under the planner, written as one self-contained page."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from moelane.commands import main
from moelane.pager.lab.policies import PlannerPolicy
from moelane.pager.lab.replay import replay
from moelane.pager.lab.report import trace_views
from moelane.pager.trace import read_trace
from moelane.server.stats import StatsResponse

TRACE = Path(__file__).parents[1] / "fixtures" / "traces" / "default.trc"


def test_trace_views_validate_and_agree_with_the_replay() -> None:
    trace = read_trace(TRACE)
    h = trace.header
    capacity = h.n_total // 2
    views = trace_views(trace, capacity, points=50)
    StatsResponse.model_validate(views)
    series, pager = views["series"], views["pager"]
    assert views["axis"] == "tokens" and views["lanes"] is None and views["requests"] is None
    assert 45 <= len(series["t"]) <= 51 and series["t"][-1] == trace.expert_ids.shape[0]
    assert all(len(v) == len(series["t"]) for k, v in series.items() if k != "read_rate")
    assert any(series["prefill"]) and not all(series["prefill"])
    rates = [r for r in series["hit_rate_decode"] if r is not None]
    assert rates and all(0 <= r <= 1 for r in rates)
    plain = replay(trace, PlannerPolicy(), capacity)  # the same replay without the report's sampling
    assert pager["phases"]["decode"]["hit_rate"] == pytest.approx(plain.decode.hit_rate)
    heat = pager["heatmap"]
    counts = np.array(heat["counts"])
    assert counts.shape == (h.n_layers, h.n_experts)
    assert (counts.sum(axis=1) == trace.expert_ids.shape[0] * h.top_k).all()  # every token's picks, per layer
    assert sum(t >= 0 for row in heat["tier"] for t in row) <= capacity
    assert pager["plan"]["n_pins"] == sum(p > 0 for row in heat["pinned"] for p in row) > 0
    read = sum(r["bytes"] for r in pager["reads"])
    assert read == plain.prefill.bytes + plain.decode.bytes


def test_analyze_writes_one_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.html"
    assert main(["trace", "analyze", str(TRACE), "--html", str(out), "--pool", "0.25"]) == 0
    assert "decode tokens" in capsys.readouterr().out  # (the text report still comes)
    page = out.read_text()
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(?!data:)", page)  # nothing fetched: all inline
    found = re.search(r'<script id="moelane-data" type="application/json">(.*?)</script>', page, re.S)
    assert found is not None
    views = json.loads(found[1])
    StatsResponse.model_validate(views)
    assert views["pager"]["n_slots"] == round(0.25 * read_trace(TRACE).header.n_total)
    assert main(["trace", "analyze", str(TRACE), "--html", str(out), "--pool", "1.5"]) == 2
    assert "--pool must be in (0, 1]" in capsys.readouterr().err
