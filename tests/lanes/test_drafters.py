"""Drafters: the 3-gram longest match (against brute force), copy silence, the shared bounded recall store, the draft
model's proposals (against its own greedy decode), and the guard's hold on drafting inside the engine."""

from __future__ import annotations

import random

import pytest

from moelane.lanes import Engine, EngineConfig, FakeClock, RecallStore
from moelane.lanes.depth import PROBE_EVERY, Acceptance
from moelane.lanes.drafters import SILENT_ROUNDS, CopyDrafter, ModelDrafter
from moelane.lanes.fake import FakeTarget, linear_price
from moelane.lanes.lane import Lane
from moelane.lanes.ngram import NgramIndex, longest_match
from moelane.lanes.stream import Stream
from moelane.model.sampling import SamplingParams
from tests.lanes.reference import solo_decode


def lane_of(tokens: list[int], n_prompt: int | None = None, max_tokens: int = 64, stream_id: int = 0) -> Lane:
    n_prompt = len(tokens) if n_prompt is None else n_prompt
    stream = Stream(stream_id, tokens[:n_prompt], max_tokens)
    lane = Lane(stream, SamplingParams(), frozenset(), None, Acceptance(8), list(tokens), n_prompt)
    lane.n_fed = len(tokens) - 1
    return lane


def brute_match(seq: list[int], max_match: int) -> int:
    """Length of the longest backward match of seq's tail ending before the tail (>= 3 tokens), else 0."""
    best = 0
    for end in range(3, len(seq)):
        k = 0
        while k < max_match and k < end and seq[end - 1 - k] == seq[-1 - k]:
            k += 1
        if k >= 3:
            best = max(best, k)
    return best


def test_longest_match_equals_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(3, 60))]
        index = NgramIndex()
        index.extend(seq[: len(seq) // 2])
        index.extend(seq)  # incremental
        found = longest_match(index, seq, seq, 64, exclude_end=len(seq))
        assert (found[1] if found else 0) == brute_match(seq, 64)
        if found:
            end, k = found
            assert seq[end - k : end] == seq[-k:]


def test_copy_proposes_what_followed_and_falls_silent_after_misses() -> None:
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    lane = lane_of([*text, 20, *text[:6]])
    drafter = CopyDrafter(min_match=6)
    assert drafter.propose([lane], [3]) == [[7, 8, 9]]
    assert drafter.propose([lane_of([*text, 20, *text[:5]])], [3]) == [[]]  # 5 < min_match: nothing
    for _ in range(4):
        drafter.feedback(lane, 3, 0)
    assert [drafter.propose([lane], [3]) for _ in range(SILENT_ROUNDS)] == [[[]]] * SILENT_ROUNDS
    assert drafter.propose([lane], [3]) == [[7, 8, 9]]


def test_copy_carries_a_repeating_tail_on_past_the_end() -> None:
    """A match that overlaps the tail (a reply repeating a short period) proposes the repeat for the whole depth,
    not just the tokens up to the end; a match far back is unchanged."""
    loop = [5, 1, 2, 9, 9, 1, 2, 1, 2, 1, 2, 1, 2]  # ... 1 2 1 2: the tail matches itself two tokens back
    assert CopyDrafter(min_match=6).propose([lane_of(loop)], [5]) == [[1, 2, 1, 2, 1]]
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert CopyDrafter(min_match=6).propose([lane_of([*text, 20, *text[:6]])], [8]) == [[7, 8, 9, 10, 20, 1, 2, 3]]


def test_recall_store_is_bounded_and_shared_across_engines() -> None:
    store = RecallStore(max_tokens=100)
    for i in range(10):
        store.add([i] * 30)
    assert store.n_tokens <= 100
    assert store.match([9, 9, 9, 9], 64) is not None and store.match([0, 0, 0], 64) is None  # the oldest went first

    store = RecallStore()
    target = FakeTarget(64, window=3)  # replies that do not repeat within themselves: only recall can draft them
    prompt = [5, 9, 2, 7, 7, 1, 3]
    rounds = []
    for _ in range(2):
        engine = Engine(target, EngineConfig(drafter="recall", timed=False), recall_store=store)
        stream = engine.submit(prompt, max_tokens=60)
        engine.run_until_idle()
        assert stream.token_ids == solo_decode(target, prompt, 60, SamplingParams())
        rounds.append(engine.stats().rounds)
    assert rounds[1] < rounds[0] / 3


def test_model_drafter_proposes_the_draft_models_greedy_continuation() -> None:
    draft = FakeTarget(32, window=2, error_rate=0.3, seed=7)
    drafter = ModelDrafter(draft, prefill_chunk=4)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    lane = lane_of(prompt, max_tokens=40)
    assert drafter.propose([lane], [3]) == [[]]  # prefilling the draft cache, a chunk a round
    assert drafter.propose([lane], [3]) == [[]]
    for extra in ([], [7, 7], [11]):  # rejected drafts, then accepted ones: the draft cache rolls back
        lane.tokens.extend(extra)
        expected = solo_decode(draft, lane.tokens, 5, SamplingParams(), frozenset())
        assert drafter.propose([lane], [5]) == [expected]
    lane.tokens.extend(expected[:3])
    assert drafter.propose([lane], [2]) == [solo_decode(draft, lane.tokens, 2, SamplingParams(), frozenset())]


def make_guarded(clock: FakeClock) -> tuple[Engine, FakeTarget]:
    target = FakeTarget(48, window=1, clock=clock, price=linear_price(0.01, 0.0001))
    return Engine(target, EngineConfig(drafter="copy", guard=True), clock=clock), target


def test_plain_rounds_propose_nothing() -> None:
    engine, _ = make_guarded(FakeClock())
    calls = []
    propose = engine.drafter.propose  # type: ignore[union-attr]
    engine.drafter.propose = lambda lanes, depths: calls.append(len(lanes)) or propose(lanes, depths)  # type: ignore[union-attr, method-assign]
    engine.submit([1, 2, 3, 1, 2, 3, 1, 2, 3], max_tokens=200)
    for _ in range(17):  # the prompt's round (not measured), 16 measured plain rounds
        engine.step()
    assert calls == [1] and engine.stats().holds == 0  # then drafting for the first drafted one
    for _ in range(10):
        engine.step()
    assert len(calls) > 5 and engine.stats().holds > 0


def test_a_stream_joining_a_plain_count_holds_no_first_drafts() -> None:
    engine, target = make_guarded(FakeClock())
    a = engine.submit([1, 2, 3, 1, 2, 3, 1, 2, 3], max_tokens=400)
    for _ in range(30):
        engine.step()
    assert engine.guard is not None and engine.guard.modes() == {1: "drafted"}
    b = engine.submit([4, 5, 6, 4, 5, 6], max_tokens=40)
    holds = engine.stats().holds
    while not b.token_ids:
        engine.step()
    for _ in range(10):
        engine.step()
    assert engine.guard.modes() == {1: "drafted", 2: "plain"}
    assert engine.stats().holds == holds  # nobody drafted at 2 streams while the guard measures plain there
    engine.run_until_idle()
    assert b.token_ids == solo_decode(target, [4, 5, 6, 4, 5, 6], 40, SamplingParams())
    assert a.token_ids == solo_decode(target, [1, 2, 3, 1, 2, 3, 1, 2, 3], 400, SamplingParams())
    assert engine.stats().holds > holds


def test_guard_keeps_a_draft_model_only_where_it_pays() -> None:
    """On the fake clock: a cheap draft model wins the guard's comparison; one wrong 9 times in 10 loses it; one as
    slow as the target is held only by the depth rule's probes (it prices it out otherwise), so it costs almost
    nothing and the guard, which measures drafting only in rounds that hold drafts, does not declare it the winner."""
    outcomes = {}
    for name, draft_cost, error_rate in (("cheap", 0.0005, 0.2), ("wrong", 0.002, 0.9), ("dear", 0.02, 0.2)):
        clock = FakeClock()
        target = FakeTarget(48, window=2, clock=clock, price=linear_price(0.02, 0.0002))
        draft = FakeTarget(48, window=2, error_rate=error_rate, clock=clock, price=linear_price(draft_cost, 0.0))
        engine = Engine(target, EngineConfig(drafter="model", max_depth=4), draft=draft, clock=clock)
        assert engine.guard is not None  # on by default for the draft model
        start = clock.now()
        stream = engine.submit([7, 3, 9, 1], max_tokens=160)
        engine.run_until_idle()
        seconds = clock.now() - start
        assert stream.token_ids == solo_decode(target, [7, 3, 9, 1], 160, SamplingParams(), frozenset())
        entry = engine.guard.entry(1)
        ratio = entry.rate_drafted / entry.rate_plain
        outcomes[name] = (entry.winner, ratio, engine.stats().holds, seconds)
    assert outcomes["cheap"][0] == "drafted" and outcomes["cheap"][1] > 1.05
    assert outcomes["wrong"][0] == "plain" and outcomes["wrong"][1] < 1.0 and outcomes["wrong"][2] > 0
    clock = FakeClock()
    plain = Engine(FakeTarget(48, window=2, clock=clock, price=linear_price(0.02, 0.0002)), clock=clock)
    start = clock.now()
    plain.submit([7, 3, 9, 1], max_tokens=160)
    plain.run_until_idle()
    plain_seconds = clock.now() - start
    assert outcomes["dear"][0] != "drafted" and 0 < outcomes["dear"][2] <= 160 // PROBE_EVERY
    # (a probe after rounds without drafts costs a catch-up pass as well as its draft pass)
    assert outcomes["dear"][3] == pytest.approx(plain_seconds, rel=0.05)


def test_a_draft_model_priced_out_recovers_by_probing() -> None:
    """A draft model whose first passes are slow (a cold start) is priced out by the depth rule; its probes, every
    8th round of the engine, measure it again once it is cheap, and drafting resumes. (When probes counted only a
    stream's rounds that held drafts, a stream priced down to none never probed again.)"""
    clock = FakeClock()
    calls = [0]

    def cold_then_cheap(n_rows: int, n_streams: int) -> float:
        calls[0] += 1
        return 0.2 if calls[0] <= 3 else 0.0005

    target = FakeTarget(48, window=2, clock=clock, price=linear_price(0.02, 0.0002))
    draft = FakeTarget(48, window=2, error_rate=0.1, clock=clock, price=cold_then_cheap)
    engine = Engine(target, EngineConfig(drafter="model", guard=False, max_depth=4), draft=draft, clock=clock)
    stream = engine.submit([7, 3, 9, 1], max_tokens=200)
    engine.run_until_idle()
    assert stream.token_ids == solo_decode(target, [7, 3, 9, 1], 200, SamplingParams(), frozenset())
    assert engine.draft_price < 0.01 and engine.stats().accepted > 50


def test_a_draft_models_price_is_of_one_level_not_of_its_catch_up() -> None:
    """Tokens committed while a stream held no drafts are fed to the draft model before its drafting passes, and
    are not counted in the price of a draft level. (Counted, a probe after 7 rounds without drafts measured an 8-row
    catch-up as one level: the price rose, drafting stayed priced out and probes kept measuring catch-ups.)"""
    clock = FakeClock()
    target = FakeTarget(48, window=2, clock=clock, price=linear_price(0.02, 0.0002))
    draft = FakeTarget(48, window=2, error_rate=0.9, clock=clock, price=linear_price(0.001, 0.002))
    engine = Engine(target, EngineConfig(drafter="model", guard=False, max_depth=4), draft=draft, clock=clock)
    stream = engine.submit([7, 3, 9, 1], max_tokens=200)
    engine.run_until_idle()
    assert stream.token_ids == solo_decode(target, [7, 3, 9, 1], 200, SamplingParams(), frozenset())
    assert engine.stats().holds > 0
    # a level feeds one row, or two (the last accepted draft and the target's token) at the first: 0.003 to 0.005
    assert 0.003 <= engine.draft_price <= 0.005


def test_a_draft_model_drafting_every_round_makes_one_pass_a_level() -> None:
    """While a stream drafts round after round, each round's first draft level feeds the last accepted draft with
    the target's token: no catch-up pass of its own (one was made every round at 70400c2)."""
    target = FakeTarget(48, window=2)
    draft = FakeTarget(48, window=2, error_rate=0.2)
    engine = Engine(target, EngineConfig(drafter="model", timed=False, max_depth=1), draft=draft)
    stream = engine.submit([7, 3, 9, 1], max_tokens=120)
    engine.run_until_idle()
    assert stream.token_ids == solo_decode(target, [7, 3, 9, 1], 120, SamplingParams(), frozenset())
    stats = engine.stats()
    assert stats.accepted > 40
    assert draft.n_passes <= stats.rounds + 1  # (+1: the prompt's prefill)
