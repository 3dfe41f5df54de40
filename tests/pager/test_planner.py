import dataclasses

import numpy as np
import pytest

from moelane.pager.planner import Planner, PlannerConfig
from moelane.pager.trace import Segment, Trace

from .helpers import small_trace


def config(trace: Trace, **kw: object) -> PlannerConfig:
    return PlannerConfig.from_header(trace.header, **kw)


def unlabelled(seg: Segment) -> Segment:
    return dataclasses.replace(seg, phase="unknown")


def test_boundary_plan_is_published_once_computed_before_the_boundary_token() -> None:
    t = small_trace(n_requests=1, decode_tokens=30)
    a, b = (
        Planner(config(t, budget_bytes=12 * t.header.expert_bytes)),
        Planner(config(t, budget_bytes=12 * t.header.expert_bytes)),
    )
    segs = list(t.segments())
    first_decode = next(i for i, s in enumerate(segs) if s.phase == "decode")
    for s in segs[:first_decode]:
        assert a.observe(s) is None or True
        b.observe(s)
    plan_b = b.begin_decode()  # engine knows the phase: before decode token 1 ran
    plan_a = a.observe(segs[first_decode])  # trace driver: on the boundary segment, before folding it in
    assert plan_a is not None and plan_b is not None
    assert plan_a.pins == plan_b.pins and plan_a.warm == plan_b.warm
    assert plan_a.warm and len(plan_a.warm) <= 12
    assert b.begin_decode() is None  # once per request
    assert all(p is None or not p.warm for p in (a.observe(s) for s in segs[first_decode + 1 :]))


def test_warm_list_is_pins_then_prefill_tail_then_most_routed() -> None:
    t = small_trace(n_requests=1)
    p = Planner(config(t, budget_bytes=24 * t.header.expert_bytes, n_pins=3))
    segs = list(t.segments())
    prefill = [s for s in segs if s.phase == "prefill"]
    for s in prefill:
        p.observe(s)
    plan = p.begin_decode()
    assert plan is not None
    pins = [(layer, e) for layer, e, _ in plan.pins]
    assert list(plan.warm[: len(pins)]) == pins
    tail = {(int(i) // 8, int(i) % 8) for i in prefill[-1].flat_ids(8)}
    n_tail_new = len(tail - set(pins))
    assert set(plan.warm[len(pins) : len(pins) + n_tail_new]) == tail - set(pins)
    assert len(plan.warm) == len(set(plan.warm)) <= 24


def test_no_warm_start_publishes_nothing_at_the_boundary() -> None:
    t = small_trace(n_requests=1)
    p = Planner(config(t, budget_bytes=12 * t.header.expert_bytes, warm_start=False, rewrite_every=1000))
    assert [p.observe(s) for s in t.segments()] == [None] * t.n_segments


def test_rewrites_every_n_segments_and_only_when_something_changed() -> None:
    t = small_trace(n_requests=1, decode_tokens=60)
    p = Planner(config(t, budget_bytes=12 * t.header.expert_bytes, rewrite_every=4, warm_start=False))
    published = [i for i, s in enumerate(t.segments()) if p.observe(s) is not None]
    assert published and all((i + 1) % 4 == 0 for i in published)
    # a trace that repeats one token: pins settle, then nothing more is published
    seg = t.segment(t.n_segments - 1)
    q = Planner(config(t, budget_bytes=12 * t.header.expert_bytes, rewrite_every=2, warm_start=False))
    out = [q.observe(seg) for _ in range(40)]
    assert sum(x is not None for x in out) <= 3 and out[-10:] == [None] * 10


def test_pins_capped_at_half_the_budget_and_window_from_the_rest() -> None:
    t = small_trace(n_requests=1, decode_tokens=40)
    eb = t.header.expert_bytes
    p = Planner(config(t, budget_bytes=10 * eb, n_pins=256))
    plans = [x for x in (p.observe(s) for s in t.segments()) if x is not None]
    assert plans
    for plan in plans:
        assert len(plan.pins) <= 5
        assert plan.window_k == max(1, (10 - len(plan.pins)) // (3 * 2))


def test_default_budget_is_one_and_a_half_first_segment() -> None:
    t = small_trace(n_requests=1)
    p = Planner(config(t))
    first = t.segment(0)
    p.observe(first)
    assert p.budget_bytes == int(np.ceil(1.5 * first.size(8))) * t.header.expert_bytes


def test_unlabelled_trace_uses_the_detector_and_rearms_per_request() -> None:
    t = small_trace(n_requests=2, prefill_tokens=20, prefill_chunk=10, decode_tokens=10)
    p = Planner(config(t, budget_bytes=12 * t.header.expert_bytes, rewrite_every=1000))
    fired = [i for i, s in enumerate(t.segments()) if p.observe(unlabelled(s)) is not None]
    labelled = Planner(config(t, budget_bytes=12 * t.header.expert_bytes, rewrite_every=1000))
    expected = [i for i, s in enumerate(t.segments()) if labelled.observe(s) is not None]
    assert len(expected) == 2
    assert fired == expected  # decode tokens are far smaller than prefill chunks here


def test_hard_pins_and_tiers_reach_the_plan() -> None:
    t = small_trace(n_requests=1)
    p = Planner(config(t, budget_bytes=12 * t.header.expert_bytes, pin_mode="hard", pin_tier=1, default_tier=2))
    plan = next(x for x in (p.observe(s) for s in t.segments()) if x is not None)
    assert plan.pin_mode == "hard" and plan.default_tier == 2 and all(tier == 1 for _, _, tier in plan.pins)


def test_config_validation() -> None:
    t = small_trace()
    with pytest.raises(ValueError):
        config(t, default_tier=9)
    with pytest.raises(ValueError):
        config(t, budget_bytes=1)
    with pytest.raises(ValueError):
        config(t, pin_mode="soft")
