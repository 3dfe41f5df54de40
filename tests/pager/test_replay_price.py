"""The replay's look-ahead loads what the live store's rule admits (lab/ahead.py, pager/price.py): everything when a
wasted load costs nothing, only confident predictions when reads are long and the disk busy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moelane.pager import price
from moelane.pager.lab.policies import make_policy
from moelane.pager.lab.replay import CostModel, ReplayResult, replay
from moelane.pager.trace import Trace

from .helpers import small_trace, with_lookahead

BIG = 9_437_184  # the inflated model's expert: 3 x 192 x 8192 bf16


def ranked_lookahead(trace: Trace, rng: np.random.Generator, accuracy: tuple[float, ...]) -> Trace:
    """`trace` with a look-ahead whose j-th prediction (router order) is right with probability `accuracy[j]`,
    else a random expert."""
    nxt = trace.expert_ids[:, 1:].astype(np.int64)
    noise = rng.integers(0, trace.header.n_experts, nxt.shape)
    right = rng.random(nxt.shape) < np.asarray(accuracy)[None, None, :]
    return dataclasses.replace(trace, lookahead=np.where(right, nxt, noise).astype(trace.expert_ids.dtype))


def run(trace: Trace, spec: str, capacity: int, cost: CostModel) -> tuple[ReplayResult, float]:
    policy = make_policy(spec)
    result = replay(trace, policy, capacity, "slots", cost)
    return result, policy.sim.ahead.threshold()


@pytest.mark.parametrize("capacity", [8, 11, 16])
def test_with_fast_reads_every_prediction_pays_and_nothing_changes(capacity: int) -> None:
    t = with_lookahead(small_trace(1, decode_tokens=60, expert_bytes=1), np.random.default_rng(1), accuracy=0.3)
    cost = CostModel(latency=0.0)  # a read of 1 byte: the disk is idle, a wasted load costs nothing
    priced, least = run(t, "lru+ahead", capacity, cost)
    every, _ = run(t, "lru+ahead:all", capacity, cost)
    assert least < 1e-3
    assert priced.decode.to_dict() == every.decode.to_dict() and priced.prefill.to_dict() == every.prefill.to_dict()
    assert priced.decode.prefetched > 0 and priced.decode.prefetch_wasted > 0  # (bad predictions loaded too)


@pytest.mark.parametrize("spec", ["lru", "planner"])
def test_with_large_experts_on_a_busy_disk_only_confident_predictions_load(spec: str) -> None:
    t = small_trace(2, n_layers=4, n_experts=16, top_k=2, decode_tokens=150, expert_bytes=BIG)
    t = ranked_lookahead(t, np.random.default_rng(2), accuracy=(0.95, 0.1))  # sure of its first pick, not its second
    cost = CostModel(compute_floor=1 / 45)  # the inflated model's decode: reads of 7 ms against 6 ms of a layer
    priced, least = run(t, f"{spec}+ahead", 12, cost)
    every, _ = run(t, f"{spec}+ahead:all", 12, cost)
    p, e = priced.decode, every.decode
    assert least > 0.3
    assert p.prefetched < 0.8 * e.prefetched and p.prefetch_wasted < 0.5 * e.prefetch_wasted
    assert p.prefetch_hits / p.prefetched > e.prefetch_hits / e.prefetched
    assert priced.to_dict()["tok_s_aggregate"] > every.to_dict()["tok_s_aggregate"]


def test_replay_and_live_decide_by_the_same_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change the rule in price.py and both the store's price and the replay follow."""
    t = with_lookahead(small_trace(3, decode_tokens=40), np.random.default_rng(3), accuracy=0.9)
    before, _ = run(t, "lru+ahead", 12, CostModel())
    assert before.decode.prefetched > 0
    monkeypatch.setattr(price, "least_probability", lambda read_s, hide_s, busy: 2.0)  # nothing pays
    store = price.LoadPrice(n_layers=3)
    store.observe_read(0.001, 1)
    store.observe_layer(0.001)
    store.observe_pass(0.01)
    after, least = run(t, "lru+ahead", 12, CostModel())
    assert store.threshold(0) == least == 2.0
    assert after.decode.prefetched < before.decode.prefetched / 10  # (loads only before the first pass is measured)


def test_the_replay_measures_a_read_a_layer_and_the_disk_as_its_cost_model_says() -> None:
    t = with_lookahead(small_trace(4, decode_tokens=40), np.random.default_rng(4), accuracy=0.7)
    cost = CostModel(latency=0.0)  # (every read then takes bytes / bandwidth, whatever its batch)
    policy = make_policy("lru+ahead")
    replay(t, policy, 10, "slots", cost)
    measured = policy.sim.ahead.price
    assert measured.read_s == pytest.approx(t.header.expert_bytes / cost.bandwidth)
    assert measured.layer_s == pytest.approx(cost.compute_floor / t.header.n_layers)
    assert measured.busy is not None and 0.0 < measured.busy <= 1.0
    rule = price.least_probability(measured.read_s, measured.layer_s, measured.busy)
    assert measured.threshold(0) == pytest.approx(rule)


def test_ahead_all_is_a_policy_name() -> None:
    assert make_policy("planner:hard+ahead:all").name == "planner:hard+ahead:all"
    assert make_policy("lru+ahead").priced and not make_policy("lru+ahead:all").priced
