import itertools
import math
from typing import Any

import numpy as np
import pytest

from moelane.errors import MoelaneError
from moelane.pager.lab.belady import Belady
from moelane.pager.lab.policies import EMA, LFU, LRU, PlannerPolicy, RecentK, make_policy
from moelane.pager.lab.replay import CostModel, PhaseStats, Simulator, replay
from moelane.pager.lab.sweep import lru_sweep
from moelane.pager.lab.synth import SynthConfig
from moelane.pager.trace import Trace

from .helpers import random_trace, reference_replay, small_trace, steps_of, with_lookahead


def same_result(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, dict):
            same_result(v, b[k])  # type: ignore[arg-type]
        elif isinstance(v, float):
            assert v == pytest.approx(b[k], rel=1e-9), k
        else:
            assert v == b[k], k


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [8, 11, 16])
def test_lru_lfu_ema_match_reference(seed: int, capacity: int) -> None:
    t = small_trace(seed)
    for policy, name in ((LRU(), "lru"), (LFU(), "lfu"), (EMA(0.5), "ema")):
        r = replay(t, policy, capacity)
        ref = reference_replay(t, capacity, name, decay=0.5)
        assert (r.prefill.hits, r.decode.hits) == (ref["prefill"], ref["decode"]), name


def no_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Simulator, "_token_fast", lambda self, flat, phase: None)


@pytest.mark.parametrize("spec", ["lru", "recent-k", "planner", "planner:hard", "planner:nowarm"])
def test_whole_token_fast_path_equals_step_by_step(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    t = small_trace(1, decode_tokens=60)
    eb = t.header.expert_bytes
    for capacity, unit in ((9, "slots"), (14, "slots"), (12 * eb, "bytes")):
        fast = replay(t, make_policy(spec), capacity, unit)
        with monkeypatch.context() as m:
            no_fast_path(m)
            slow = replay(t, make_policy(spec), capacity, unit)
        same_result(fast.to_dict(), slow.to_dict())
        assert np.array_equal(fast.token_hits, slow.token_hits)


def test_fast_path_with_precision_tiers_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    t = small_trace(3, decode_tokens=60)
    budget = 9 * t.header.expert_bytes
    fast = replay(t, PlannerPolicy(pin_tier=1, default_tier=2), budget, "bytes")
    with monkeypatch.context() as m:
        no_fast_path(m)
        slow = replay(t, PlannerPolicy(pin_tier=1, default_tier=2), budget, "bytes")
    same_result(fast.to_dict(), slow.to_dict())


def test_planner_with_tiers_in_bytes_never_exceeds_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    t = small_trace(2, decode_tokens=40)
    eb = t.header.expert_bytes
    budget = 10 * eb
    used: list[int] = []
    orig = Simulator.run_segment

    def spy(self: Simulator, seg: object, pos: int) -> None:
        orig(self, seg, pos)  # type: ignore[arg-type]
        used.append(self.used)

    monkeypatch.setattr(Simulator, "run_segment", spy)
    r = replay(t, PlannerPolicy(pin_tier=1, default_tier=2), budget, "bytes")
    assert max(used) <= budget
    # cold misses load at the int4 tier: fewer bytes than the same misses at tier 0
    assert 0 < r.decode.bytes - r.warm_bytes < r.decode.misses * eb


def test_recent_k_keeps_only_last_k_tokens() -> None:
    t = small_trace(0)
    r1, big = replay(t, RecentK(1), 24), replay(t, LRU(), 24)
    assert r1.decode.hit_rate <= big.decode.hit_rate


def test_cost_model_and_per_token_figures() -> None:
    t = small_trace(0)
    cost = CostModel(bandwidth=1e9, latency=1e-3, compute_floor=0.01)
    r = replay(t, LRU(), 10, cost=cost)
    eb = t.header.expert_bytes
    assert r.decode.bytes == r.decode.misses * eb
    assert r.token_hits.sum() == r.decode.hits and r.token_accesses.sum() == r.decode.accesses
    assert np.isclose(r.token_stall.sum(), r.decode.stall_s)
    assert r.decode.stall_s >= r.decode.bytes / 1e9
    d = r.to_dict()
    assert np.isclose(d["tok_s_aggregate"], r.decode.n_tokens / (r.decode.stall_s + 0.01 * r.decode.n_tokens))
    assert r.token_pos.max() == 19 and (r.token_pos == 0).sum() == 2


def test_too_small_pool_is_a_clear_error() -> None:
    t = small_trace(0)
    with pytest.raises(MoelaneError):
        replay(t, LRU(), 3)  # a prefill step needs more than 3 experts


@pytest.mark.parametrize("seed", range(3))
def test_lru_stack_sweep_equals_replay(seed: int) -> None:
    t = small_trace(seed)
    caps = [8, 9, 12, 16, 24]
    for swept, cap in zip(lru_sweep(t, caps), caps, strict=True):
        direct = replay(t, LRU(), cap)
        same_result(swept.to_dict(), direct.to_dict())


# --- Belady against exhaustive search ---


def brute_force_misses(steps: list[list[int]], capacity: int) -> int:
    """Minimum misses over every legal pool content after every step (any subset that holds the step)."""
    memo: dict[tuple[int, frozenset[int]], int] = {}

    def best(i: int, pool: frozenset[int]) -> int:
        if i == len(steps):
            return 0
        key = (i, pool)
        if key in memo:
            return memo[key]
        need = frozenset(steps[i])
        cost = len(need - pool)
        others = sorted(pool - need)
        room = capacity - len(need)
        result = min(
            best(i + 1, need | frozenset(keep))
            for n in range(min(room, len(others)) + 1)
            for keep in itertools.combinations(others, n)
        )
        memo[key] = cost + result
        return memo[key]

    return best(0, frozenset())


def step_misses(t: Trace, policy: object, capacity: int) -> int:
    r = replay(t, policy, capacity)  # type: ignore[arg-type]
    return r.prefill.misses + r.decode.misses


@pytest.mark.parametrize("seed", range(12))
def test_belady_is_optimal_by_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layers, n_experts, top_k = int(rng.integers(1, 3)), int(rng.integers(3, 5)), 2
    t = random_trace(rng, n_layers, n_experts, top_k, int(rng.integers(4, 8)))
    steps = [s for s, _ in steps_of(t)]
    for capacity in range(top_k, min(n_layers * n_experts, 5) + 1):
        optimum = brute_force_misses(steps, capacity)
        assert step_misses(t, Belady(), capacity) == optimum
        for other in (LRU(), LFU(), EMA(0.5)):
            assert step_misses(t, other, capacity) >= optimum


def fetched_bytes(t: Trace, policy: object, capacity: int) -> int:
    r = replay(t, policy, capacity)  # type: ignore[arg-type]
    return r.prefill.bytes + r.decode.bytes  # demand misses and the planner's warm-start loads


def test_belady_fetches_least_of_every_policy_on_synthetic_traces() -> None:
    t = small_trace(5)
    for cap in (10, 16):
        best = fetched_bytes(t, Belady(), cap)
        for spec in ("lru", "lfu", "recent-k", "ema:0.85", "bandit", "planner", "planner:hard", "planner:score"):
            assert fetched_bytes(t, make_policy(spec), cap) >= best, spec


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("capacity", [8, 11, 16])
def test_lookahead_prefetch_matches_reference(seed: int, capacity: int) -> None:
    t = with_lookahead(small_trace(seed, decode_tokens=40), np.random.default_rng(seed))
    for spec, name in (("lru+ahead:all", "lru"), ("lfu+ahead:all", "lfu")):  # (the reference loads every prediction)
        r = replay(t, make_policy(spec), capacity)
        ref = reference_replay(t, capacity, name, ahead=True)
        assert (r.prefill.hits, r.decode.hits, r.decode.prefetched) == (
            ref["prefill"],
            ref["decode"],
            ref["prefetched"],
        )
        assert r.decode.prefetch_hits <= r.decode.prefetched and r.policy == spec


def test_a_perfect_lookahead_leaves_only_layer_zero_to_miss() -> None:
    t = small_trace(2, decode_tokens=40)
    perfect = with_lookahead(t, np.random.default_rng(0), accuracy=1.0)
    h = t.header
    r = replay(perfect, make_policy("lru+ahead"), 3 * h.top_k)  # room for a step and the next layer's prediction
    layer0 = replay(t, make_policy("lru"), 3 * h.top_k)
    assert r.decode.misses <= layer0.decode.misses
    steps = [ids for ids, decode in steps_of(t) if decode]
    n_layer0 = sum(len(ids) for i, ids in enumerate(steps) if i % h.n_layers == 0)
    assert r.decode.misses <= n_layer0  # every layer >= 1 was loaded before it ran
    assert r.decode.prefetch_hits == r.decode.prefetched


def test_planner_with_lookahead_never_exceeds_budget_and_beats_demand_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    t = with_lookahead(small_trace(4, decode_tokens=80), np.random.default_rng(4), accuracy=0.8)
    budget = 10 * t.header.expert_bytes
    used: list[int] = []
    prefetch = Simulator.prefetch

    def spy(self: Simulator, ids: np.ndarray, protect: np.ndarray, phase: PhaseStats) -> float:
        stall = prefetch(self, ids, protect, phase)
        used.append(self.used)
        return stall

    monkeypatch.setattr(Simulator, "prefetch", spy)
    lru = replay(t, make_policy("lru"), budget, "bytes").decode.hit_rate
    for spec in ("planner+ahead", "planner:hard+ahead", "planner:score+ahead"):
        used.clear()
        r = replay(t, make_policy(spec), budget, "bytes")
        assert used and max(used) <= budget
        assert r.decode.hit_rate > lru and r.decode.prefetched > 0


def test_lookahead_policies_need_a_trace_that_carries_it() -> None:
    with pytest.raises(MoelaneError, match="does not carry"):
        replay(small_trace(0), make_policy("planner+ahead"), 10)
    with pytest.raises(MoelaneError, match="belady"):
        make_policy("belady+ahead")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CostModel(bandwidth=math.nan), "bandwidth must be a finite number > 0"),
        (lambda: CostModel(latency=math.inf), "latency must be a finite number >= 0"),
        (lambda: CostModel(compute_floor=-1.0), "compute_floor must be a finite number >= 0"),
        (lambda: SynthConfig(skew=math.nan), "skew must be a finite number >= 0"),
        (lambda: SynthConfig(locality=math.inf), "locality must be a finite number >= 0"),
    ],
)
def test_costs_and_synthetic_settings_refuse_nan_and_inf(make: Any, message: str) -> None:
    """Checked where they are defined (the CLI names the flag: `in_flags`); NaN once passed `< 0` checks."""
    with pytest.raises(ValueError, match=message):
        make()
