"""`GET /v1/stats`, what the dashboard draws: live responses validate against the schema (stats.py), with a pager's
store and without one; samples are taken only when the endpoint is asked, at most once per interval; each series
point is a rate over its interval, null across a gap; the request log keeps the last requests, their prompt text
only when asked to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import moelane
from moelane.lanes.config import EngineConfig
from moelane.lanes.engine import EngineStats
from moelane.lanes.guard import DRAFTED, MEASURE_ROUNDS, PLAIN, Guard
from moelane.server.app import create_app
from moelane.server.cost import pager_hooks
from moelane.server.sampler import RequestLog, Sampler
from moelane.server.stats import LanesView, StatsResponse
from moelane.server.views import lanes_view
from tests.helpers import random_model
from tests.server.conftest import MODEL, make_engine, running
from tests.server.fake_engine import FakeEngine

PROMPT = "def fibonacci(n):"


@pytest.fixture
def paged_lm(tmp_path: Path) -> Iterator[Any]:
    """The tiny qwen3_moe with half its experts' bytes in an expert store (2 MoE layers x 10 experts)."""
    folder = random_model("qwen3_moe", tmp_path)
    lm = moelane.load(folder, expert_memory="50%")
    yield lm
    lm.close()


def stats(url: str, **kw: Any) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/stats", **kw)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body: dict[str, Any] = r.json()
    StatsResponse.model_validate(body)  # every field known and of its type (extra fields are refused)
    series = body["series"]
    lengths = {len(v) for k, v in series.items() if k != "read_rate"} | {len(v) for v in series["read_rate"].values()}
    assert lengths == {len(series["t"])}, lengths
    return body


def completion(url: str, max_tokens: int = 8, stream: bool = False) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_paged_model_stats_validate_and_show_the_pool(paged_lm: Any) -> None:
    app = create_app(make_engine(paged_lm), paged_lm, model_name=MODEL, pager=pager_hooks(paged_lm))
    now = [0.0]
    app.state.moelane.sampler.clock = lambda: now[0]
    with running(app) as url:
        first = stats(url)
        assert first["series"]["t"] == []  # the first sample is the baseline of the next one's rates
        completion(url, 12)
        completion(url, 6, stream=True)
        now[0] += 1.0
        body = stats(url)
    series, pager, lanes = body["series"], body["pager"], body["lanes"]
    assert len(series["t"]) == 1 and series["tok_s"][0] > 0 and series["prefill"] == [True]
    assert 0 <= series["hit_rate_decode"][0] <= 1 and series["rows_per_round"][0] >= 1
    assert pager["paged"] and pager["policy"] == "planner" and pager["n_slots"] == 10
    assert pager["phases"]["decode"]["accesses"] > 0 and pager["phases"]["prefill"]["accesses"] > 0
    heat = pager["heatmap"]
    assert heat["layers"] == paged_lm.moe_layers and heat["n_experts"] == 10
    assert [len(row) for row in heat["tier"]] == [10, 10] and heat["counts"] is not None
    held = sum(t >= 0 for row in heat["tier"] for t in row)
    assert held == paged_lm.provider.table.n_held and sum(map(sum, heat["counts"])) > 0
    assert pager["plan"] is not None and pager["plan"]["version"] >= 1 and pager["bandit"] is not None
    assert len(pager["bandit"]["weights"]) == len(pager["bandit"]["decays"])
    assert sum(r["bytes"] for r in pager["reads"]) > 0
    assert lanes["committed"] >= 18 and lanes["drafter"] == "none" and lanes["guard"] is None
    newest, older = body["requests"]
    assert (newest["completion_tokens"], older["completion_tokens"]) == (6, 12)
    assert newest["prompt_tokens"] == len(paged_lm.tokenizer.encode(PROMPT)) and newest["prompt_text"] is None
    assert newest["ttft_s"] > 0 and newest["bytes_paged"] >= 0 and newest["endpoint"] == "completions"


def test_resident_model_stats_say_there_is_no_pager(tiny_lm: Any) -> None:
    app = create_app(make_engine(tiny_lm), tiny_lm, model_name=MODEL, show_text=True, request_log=2)
    with running(app) as url:
        for _ in range(3):
            completion(url, 3)
        body = stats(url)
        schema = httpx.get(f"{url}/openapi.json").json()
    assert schema["paths"]["/v1/stats"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/StatsResponse"
    }
    pager = body["pager"]
    assert not pager["paged"] and "no pager" in pager["note"] and pager["heatmap"]["counts"] is None
    assert len(pager["heatmap"]["tier"]) == len(tiny_lm.moe_layers)
    assert len(body["requests"]) == 2 and body["requests"][0]["prompt_text"] == PROMPT


def counting_engine() -> Any:
    engine = FakeEngine([5, 6, 7])
    calls = []
    plain = engine.stats

    def stats() -> EngineStats:
        calls.append(1)
        return plain()

    engine.stats = stats  # type: ignore[method-assign]
    return engine, calls


def test_nothing_is_sampled_unless_asked_and_then_at_most_once_an_interval() -> None:
    engine, calls = counting_engine()
    now = [100.0]
    sampler = Sampler(engine, SimpleNamespace(), MODEL, RequestLog(), clock=lambda: now[0])
    assert calls == []  # built, nobody watching: nothing read
    one, two = sampler.body(), sampler.body()
    assert one is two and len(calls) == 1
    now[0] += 0.99
    assert sampler.body() is one and len(calls) == 1
    now[0] += 0.02
    three = json.loads(sampler.body())
    assert len(calls) == 2 and len(three["series"]["t"]) == 1
    StatsResponse.model_validate(three)


def test_each_point_is_a_rate_over_its_interval_and_a_gap_is_null() -> None:
    counts = {"committed": 0, "rounds": 0}
    engine = SimpleNamespace(stats=lambda: EngineStats(**counts, n_active=2))
    now = [0.0]
    sampler = Sampler(engine, SimpleNamespace(), MODEL, RequestLog(), clock=lambda: now[0])
    sampler.sample(now[0])
    for dt, tokens, rounds in ((1.0, 50, 25), (2.0, 40, 10), (10.0, 500, 100)):
        now[0] += dt
        counts["committed"] += tokens
        counts["rounds"] += rounds
        body = sampler.sample(now[0])
    series = body["series"]
    assert series["tok_s"] == [50.0, 20.0, None] and series["rounds_s"] == [25.0, 5.0, None]
    assert series["active"] == [2, 2, None]
    StatsResponse.model_validate(body)


def test_the_guard_says_its_verdict_and_when_it_measures_again() -> None:
    guard = Guard()
    for _ in range(MEASURE_ROUNDS[PLAIN]):  # plain measured at 2 streams: drafted is measured next
        guard.observe(2, PLAIN, 10, 0.01, True)
    engine = SimpleNamespace(config=EngineConfig(drafter="copy", guard=True), guard=guard)
    view = lanes_view(engine, EngineStats(holds=8, accepted=6, guard_modes=guard.modes()))
    LanesView.model_validate(view)
    assert view["acceptance"] == 0.75 and view["drafter"] == "copy"
    row = {"streams": 2, "mode": DRAFTED, "state": "measuring", "rounds_left": MEASURE_ROUNDS[DRAFTED],
           "rate_plain": 1000.0, "rate_drafted": None, "decisions": 0}  # fmt: skip
    assert view["guard"] == [row]
