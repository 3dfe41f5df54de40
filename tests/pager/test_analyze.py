import dataclasses

import numpy as np
import pytest

from moelane.pager.lab.analyze import analyze
from moelane.pager.lab.predict import CooccurrencePredictor
from moelane.pager.trace import Segment, TraceHeader, trace_from_segments

from .helpers import small_trace, with_lookahead


def hand_trace() -> object:
    """1 layer, 6 experts, top-2. Prefill segments {0,1},{1,2} then decode tokens {1,3}, {3,4}, {0,5}."""
    h = TraceHeader(1, 6, 2, (("bf16", 4),))
    rows = [[[0, 1]], [[1, 2]]]
    segs = [Segment(0, "prefill", np.array([rows[0]], np.uint8), np.zeros(1, np.int64)),
            Segment(1, "prefill", np.array([rows[1]], np.uint8), np.zeros(1, np.int64))]  # fmt: skip
    for i, tok in enumerate([[1, 3], [3, 4], [0, 5]]):
        segs.append(Segment(2 + i, "decode", np.array([[tok]], np.uint8), np.zeros(1, np.int64)))
    return trace_from_segments(h, segs)


def test_coverage_on_a_hand_made_trace() -> None:
    cov = analyze(hand_trace())["overall"]["coverage"]  # type: ignore[arg-type]
    c = {k: v["coverage"] for k, v in cov.items()}
    # union {0,1,2}: 1/2, 0/2, 1/2; tail {1,2}: 1/2, 0, 0; stable {1}: 1/2, 0, 0
    assert c["prefill_union"] == pytest.approx((0.5 + 0 + 0.5) / 3)
    assert c["prefill_tail"] == pytest.approx(0.5 / 3)
    assert c["stable"] == pytest.approx(0.5 / 3)
    # decode recency: {} -> 0; {1,3} -> 1/2; {1,3,4} -> 0
    assert c["decode_recency"] == pytest.approx(0.5 / 3)
    # last 1 token: {1,2} -> 1/2; {1,3} -> 1/2; {3,4} -> 0
    assert c["last_1"] == pytest.approx(1 / 3)
    # last 2: {0,1,2} -> 1/2; {1,2,3} -> 1/2; {1,3,4} -> 0
    assert c["last_2"] == pytest.approx(1 / 3)
    assert cov["prefill_union"]["size"] == 3 and cov["stable"]["size"] == 1
    # frequency top-K (K = 2): prefill counts 0:1, 1:2, 2:1 -> {1, 0}: 1/2, 0, 1/2
    assert c["freq_top_k"] == pytest.approx(1 / 3)
    # oracle of 2: decode counts 3:2, then 0,1,4,5 once -> {3, 0}: 1/2, 1/2, 1/2
    assert c["oracle_k"] == pytest.approx(0.5)


def test_oracle_bounds_every_static_set_of_its_size() -> None:
    rep = analyze(small_trace(3))
    for r in rep["requests"]:
        c = r["coverage"]
        assert c["oracle_k"]["coverage"] >= c["freq_top_k"]["coverage"] - 1e-12
        assert c["oracle_union"]["coverage"] >= c["prefill_union"]["coverage"] - 1e-12
        assert c["last_1"]["coverage"] <= c["last_2"]["coverage"] <= c["last_4"]["coverage"]
    assert len(rep["layers"]) == 3 and sum(rep["layers"][0]["counts"]) == small_trace(3).n_tokens * 2


def test_predictor_stats_are_consistent() -> None:
    for r in analyze(small_trace(4))["requests"]:
        p = r["predictors"]
        rep, delta, sched = p["repeat_recall"], p["delta_recall"], p["schedulable_coverage"]
        assert sched == pytest.approx(rep + (1 - rep) * delta)
        assert 0 < rep < 1 and 0 < delta < 1


def test_cooccurrence_learns_a_deterministic_transition() -> None:
    pred = CooccurrencePredictor(1, 5)
    a, b = np.array([[0, 1]]), np.array([[2, 3]])
    for _ in range(3):
        pred.observe(a, b)
        pred.observe(b, a)
    assert set(pred.predict(a, 2)[0].tolist()) == {2, 3}
    assert pred.predict(np.array([[4, 0]]), 3)[0].tolist()[:2] in ([2, 3], [3, 2])


def test_lookahead_scores_a_perfect_and_a_useless_prediction() -> None:
    t = small_trace(5, decode_tokens=30)
    perfect = analyze(with_lookahead(t, np.random.default_rng(0), accuracy=1.0))["overall"]["lookahead"]
    plain = analyze(t)["overall"]
    assert "lookahead" not in plain
    assert perfect["recall"] == 1.0 and perfect["repeat_recall"] == plain["predictors"]["repeat_recall"]
    h = t.header
    nxt = t.expert_ids[:, 1:].reshape(-1, h.top_k)
    wrong = np.array([[e for e in range(h.n_experts) if e not in row][: h.top_k] for row in nxt.tolist()])
    useless = dataclasses.replace(t, lookahead=wrong.reshape(nxt.shape[0] // (h.n_layers - 1), -1, h.top_k))
    assert analyze(useless)["overall"]["lookahead"]["recall"] == 0.0
    assert analyze(useless)["overall"]["lookahead"]["delta_recall"] == 0.0
