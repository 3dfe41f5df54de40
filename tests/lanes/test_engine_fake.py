"""The engine against the fake target (SPEC 3.8) with an injected clock: token identity with solo decode, continuous
batching, chunked prefill, stop / length / cancel, the clock-free schedule of `timed=False`, threaded mode."""

from __future__ import annotations

import threading

import pytest
import torch

from moelane.errors import InputError
from moelane.lanes import Engine, EngineConfig, FakeClock
from moelane.lanes.fake import FakeTarget, linear_price
from moelane.lanes.request import submit_kwargs
from moelane.model.cache import Rows
from moelane.model.sampling import SamplingParams
from tests.lanes.reference import prompts, solo_decode

VOCAB = 48
EOS = frozenset({0})
MAX_TOKENS = 40


def make(drafter: str = "none", clock: FakeClock | None = None, **config: object) -> tuple[Engine, FakeTarget]:
    clock = clock or FakeClock()
    target = FakeTarget(VOCAB, window=1, eos_ids=EOS, clock=clock, price=linear_price(0.010, 0.0005))
    draft = FakeTarget(VOCAB, window=1, error_rate=0.2, clock=clock, price=linear_price(0.001, 0.0001))
    return Engine(target, EngineConfig(drafter=drafter, **config), draft=draft, clock=clock), target  # type: ignore[arg-type]


def params_of(i: int) -> SamplingParams:
    """Greedy, sampled, and each of them with logit bias and penalties (which make a token depend on the reply)."""
    if i % 4 == 2:
        return SamplingParams(logit_bias=((3, 1.5), (7, -100.0)), presence_penalty=0.8, frequency_penalty=0.6)
    if i % 4 == 3:
        return SamplingParams(temperature=0.9, seed=1000 + i, logit_bias=((5, 2.0),), frequency_penalty=1.2)
    return SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.9, top_k=20, seed=1000 + i)


@pytest.fixture(scope="module")
def cases() -> list[tuple[list[int], SamplingParams, list[int]]]:
    target = FakeTarget(VOCAB, window=1, eos_ids=EOS)
    return [
        (p, params_of(i), solo_decode(target, p, MAX_TOKENS, params_of(i))) for i, p in enumerate(prompts(24, VOCAB))
    ]


def submit_all(engine: Engine, cases: list[tuple[list[int], SamplingParams, list[int]]]) -> list:
    return [engine.submit(p, max_tokens=MAX_TOKENS, **submit_kwargs(sp)) for p, sp, _ in cases]


@pytest.mark.parametrize("n_streams", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("drafter", ["none", "copy", "recall", "model"])
@pytest.mark.parametrize("guard", [False, True])
def test_replies_equal_solo_decode(cases, n_streams: int, drafter: str, guard: bool) -> None:
    engine, _ = make(drafter, guard=guard, max_streams=n_streams, prefill_chunk=8)
    streams = submit_all(engine, cases)
    engine.run_until_idle()
    for stream, (_, _, expected) in zip(streams, cases, strict=True):
        assert stream.token_ids == expected
        assert stream.finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    if drafter != "none" and not guard:
        assert engine.stats().holds > 0 and engine.stats().accepted > 0


@pytest.mark.parametrize("drafter", ["none", "copy"])
def test_logprobs_equal_those_of_solo_decode(cases, drafter: str) -> None:
    """Each committed token's log-probability (and the top 3) is the log-softmax of the logits its solo decode
    chose it from, whatever shares the round and whether it was a drafted row."""
    engine, _ = make(drafter, max_streams=6, prefill_chunk=8)
    streams = [engine.submit(p, max_tokens=MAX_TOKENS, logprobs=3 if i % 2 else 0, prompt_logprobs=i % 4 == 1,
                             **submit_kwargs(sp))
               for i, (p, sp, _) in enumerate(cases[:12])]  # fmt: skip
    plain = engine.submit(cases[0][0], max_tokens=5)
    engine.run_until_idle()
    assert plain.logprobs == []  # not asked for
    fresh = FakeTarget(VOCAB, window=1, eos_ids=EOS)
    for i, (stream, (prompt, _, expected)) in enumerate(zip(streams, cases, strict=False)):
        assert stream.token_ids == expected
        history = list(prompt)
        assert len(stream.logprobs) == len(expected)
        for token, entry in zip(expected, stream.logprobs, strict=True):
            cache = fresh.cache_for(len(history), 1)
            want = torch.log_softmax(fresh.forward([Rows(cache, history, 0)])[0][-1].float(), dim=-1)
            assert entry.token_id == token and entry.logprob == pytest.approx(float(want[token]), abs=1e-5)
            top = torch.topk(want, 3) if i % 2 else None
            assert [t for t, _ in entry.top] == (top.indices.tolist() if top is not None else [])
            history.append(token)
        if i % 4 == 1:  # the prompt's own, from a pass over the prompt (chunked by 8 in the engine)
            cache = fresh.cache_for(len(prompt), 1)
            rows = torch.log_softmax(fresh.forward([Rows(cache, list(prompt), 0)])[0].float(), dim=-1)
            assert stream.prompt_logprobs[0] is None and len(stream.prompt_logprobs) == len(prompt)
            got = [e.logprob for e in stream.prompt_logprobs[1:]]  # type: ignore[union-attr]
            assert got == pytest.approx([float(rows[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-5)
        else:
            assert stream.prompt_logprobs == []
    if drafter == "copy":
        assert engine.stats().accepted > 0
    with pytest.raises(InputError, match="logprobs"):
        engine.submit([1], logprobs=21)
    with pytest.raises(InputError, match="prompt_logprobs needs logprobs"):
        engine.submit([1], prompt_logprobs=True)


@pytest.mark.parametrize("drafter", ["copy", "model"])
def test_overlapped_passes_change_nothing(cases, drafter: str) -> None:
    """overlap=True: newcomers are admitted and prepared (prompt index, draft-model prefill) during a pass."""
    engine, _ = make(drafter, guard=False, max_streams=4, overlap=True, timed=False)
    streams = submit_all(engine, cases)
    engine.run_until_idle()
    assert [s.token_ids for s in streams] == [c[2] for c in cases]
    assert engine.stats().accepted > 0


def test_drafting_saves_rounds(cases) -> None:
    rounds = {}
    for drafter in ("none", "copy", "model"):
        engine, _ = make(drafter, guard=False, max_streams=1)
        submit_all(engine, cases[:6])
        engine.run_until_idle()
        rounds[drafter] = engine.stats().rounds
    assert rounds["copy"] < rounds["none"] and rounds["model"] < rounds["none"]


def test_untimed_schedule_ignores_the_clock(cases) -> None:
    """timed=False: the same streams on a fast (0.5 ms) and a slow (400 ms) clock give equal holds and replies."""
    results = []
    for seconds in (0.0005, 0.4):
        clock = FakeClock()
        target = FakeTarget(VOCAB, window=1, eos_ids=EOS, clock=clock, price=lambda n, s, t=seconds: t)
        draft = FakeTarget(VOCAB, window=1, error_rate=0.2, clock=clock, price=lambda n, s, t=seconds: t / 3)
        for drafter, d in (("copy", None), ("model", draft)):
            engine = Engine(target, EngineConfig(drafter=drafter, timed=False, guard=True, max_streams=4), draft=d,
                            clock=clock)  # fmt: skip
            streams = submit_all(engine, cases)
            engine.run_until_idle()
            stats = engine.stats()
            results.append((drafter, stats.rounds, stats.holds, stats.accepted, [s.token_ids for s in streams]))
            assert stats.guard_modes == {} and stats.holds > 0
    assert results[:2] == results[2:]


def test_streams_join_and_leave_between_rounds(cases) -> None:
    engine, target = make("copy", max_streams=4, prefill_chunk=4)
    first = [engine.submit(p, max_tokens=MAX_TOKENS) for p, _, _ in cases[:2]]
    for _ in range(5):
        engine.step()
    assert engine.n_active == 2 and all(0 < len(s.token_ids) < MAX_TOKENS for s in first)
    late = [engine.submit(p, max_tokens=MAX_TOKENS) for p, _, _ in cases[2:10:2]]
    assert engine.n_waiting == 4
    engine.step()
    assert engine.n_active == 4 and engine.n_waiting == 2  # two admitted up to max_streams, two wait
    engine.run_until_idle()
    greedy = [c for c in cases[:2]] + [cases[i] for i in range(2, 10, 2)]
    for stream, (p, _, _) in zip(first + late, greedy, strict=True):
        assert stream.token_ids == solo_decode(target, p, MAX_TOKENS, SamplingParams())
    assert engine.n_active == 0 and engine.n_waiting == 0


def test_chunked_prefill_shares_a_round_with_decoding() -> None:
    engine, target = make("none", max_streams=2, prefill_chunk=4)
    seen = []
    forward = target.forward
    target.forward = lambda rows, last_only=False: (
        seen.append([len(r.token_ids) for r in rows])
        or forward(  # type: ignore[method-assign]
            rows, last_only
        )
    )
    a = engine.submit([1, 2, 3], max_tokens=20)
    engine.step()
    b = engine.submit(list(range(1, 15)), max_tokens=5)
    engine.run_until_idle()
    assert [1, 4] in seen  # a decodes while b feeds a chunk of 4 of its 14 prompt tokens
    assert max(max(s) for s in seen) <= 4
    assert b.token_ids == solo_decode(target, list(range(1, 15)), 5, SamplingParams())
    assert a.token_ids == solo_decode(target, [1, 2, 3], 20, SamplingParams())


def test_least_recently_served_first_under_a_row_limit() -> None:
    engine, _ = make("none", max_streams=4, max_rows=4, prefill_chunk=4)
    streams = [engine.submit([i + 1] * 9, max_tokens=8) for i in range(4)]
    engine.run_until_idle()
    assert all(len(s.token_ids) == 8 or s.finish_reason == "stop" for s in streams)


def test_stop_tokens_cancel_and_errors() -> None:
    engine, target = make("copy")
    reference = solo_decode(target, [3, 4, 5], 30, SamplingParams())
    stop = reference[5]
    s_stop = engine.submit([3, 4, 5], max_tokens=30, stop_token_ids=[stop])
    s_cancel = engine.submit([3, 4, 5], max_tokens=30)
    engine.step()
    s_cancel.cancel()
    engine.run_until_idle()
    assert s_stop.token_ids == reference[: reference.index(stop)] and s_stop.finish_reason == "stop"
    assert s_cancel.finish_reason == "cancelled" and s_cancel.token_ids == reference[: len(s_cancel.token_ids)]
    with pytest.raises(InputError):
        engine.submit([], max_tokens=3)
    with pytest.raises(InputError):
        engine.submit([VOCAB], max_tokens=3)
    with pytest.raises(InputError):
        engine.submit([1], temperature=-1.0)
    with pytest.raises(InputError, match="finite"):
        engine.submit([1], temperature=float("inf"))
    with pytest.raises(InputError, match="logit_bias token id"):
        engine.submit([1], logit_bias={VOCAB: 1.0})
    with pytest.raises(InputError, match="presence_penalty"):
        engine.submit([1], presence_penalty=2.5)
    with pytest.raises(InputError, match="not text"):
        engine.submit("3 4 5", max_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="must be integers"):
        engine.submit([3, 4.5], max_tokens=3)  # type: ignore[list-item]
    assert engine.submit(torch.tensor([3, 4, 5]), max_tokens=3).prompt_ids == [3, 4, 5]  # type: ignore[arg-type]


class PoisonedTarget(FakeTarget):
    """Fails every pass that holds the first rows of a prompt that starts with POISON."""

    def forward(self, rows, last_only=False):  # type: ignore[no-untyped-def]
        if any(r.start == 0 and r.token_ids[0] == POISON for r in rows):
            raise RuntimeError("poisoned pass (test)")
        return super().forward(rows, last_only)


POISON = 7


@pytest.mark.parametrize("drafter", ["none", "copy"])
def test_a_failing_stream_fails_alone(cases, drafter: str) -> None:
    """A round that fails is rerun stream by stream: the stream that fails alone ends with "error", the streams that
    shared its round go on and still equal their solo decode."""
    target = PoisonedTarget(VOCAB, window=1, eos_ids=EOS)
    engine = Engine(target, EngineConfig(drafter=drafter, timed=False))  # type: ignore[arg-type]
    healthy = [c for c in cases if c[0][0] != POISON][:5]
    streams = submit_all(engine, healthy[:2])
    bad = engine.submit([POISON, 3, 4], max_tokens=MAX_TOKENS)
    streams += submit_all(engine, healthy[2:])
    engine.run_until_idle()
    assert bad.finish_reason == "error" and bad.token_ids == []
    for stream, (_, _, expected) in zip(streams, healthy, strict=True):
        assert stream.token_ids == expected and stream.finish_reason in ("stop", "length")
    assert engine.n_active == 0


def test_threaded_mode_streams_tokens_as_they_commit(cases) -> None:
    engine = Engine(FakeTarget(VOCAB, window=1, eos_ids=EOS), EngineConfig(drafter="copy"))
    engine.start()
    try:
        streams = submit_all(engine, cases[:8])
        got: list[list[int]] = [[] for _ in streams]

        def read(i: int) -> None:
            got[i].extend(streams[i])

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout=60)
    finally:
        engine.stop()
    for g, s, (_, _, expected) in zip(got, streams, cases[:8], strict=True):
        assert g == s.token_ids == expected


def test_stop_cancels_running_streams() -> None:
    engine = Engine(FakeTarget(VOCAB, window=1), EngineConfig())
    stream = engine.submit([1, 2], max_tokens=100_000)
    engine.start()
    while len(stream.token_ids) < 3:
        stream.wait(0.01)
    engine.stop()
    assert stream.finish_reason == "cancelled" and engine.n_active == 0


def test_timed_prices_are_measured_at_start_up_and_as_rounds_run() -> None:
    clock = FakeClock()
    target = FakeTarget(VOCAB, window=1, clock=clock, price=linear_price(0.010, 0.001))
    engine = Engine(target, EngineConfig(drafter="copy", max_rows=64), clock=clock)
    assert [n for n, _ in engine.prices.points] == [1, 2, 4, 8, 16, 32, 64]
    for n, cost in engine.prices.points:
        assert cost == pytest.approx(0.010 + 0.001 * n)
    target.price = linear_price(0.020, 0.001)  # the machine got slower
    engine.submit([1, 2, 3], max_tokens=30)
    engine.run_until_idle()
    assert engine.prices.price(1) > 0.015
    fixed = Engine(target, EngineConfig(drafter="copy", timed=False), clock=clock)
    assert fixed.prices.points == sorted(EngineConfig().prices)


def test_the_guard_does_not_measure_rounds_that_feed_a_prompt() -> None:
    """A prompt chunk's round measures the prompt, not the mode: counted, a joining stream's prefill would decide the
    guard's choice for its stream count (the rounds of 40 prompt tokens in chunks of 8 leave the measurement as it
    was; the first decode round is its first measured round)."""
    engine, _ = make("copy", guard=True, prefill_chunk=8)
    engine.submit([1 + i % 40 for i in range(40)], max_tokens=30, stop_token_ids=None)
    assert engine.guard is not None
    entry = engine.guard.entry(1)
    for _ in range(5):
        engine.step()
    assert (entry.left, entry.tokens, entry.seconds) == (16, 0, 0.0)
    engine.step()
    assert entry.left == 15 and entry.tokens == 1 and entry.seconds > 0


def test_the_guard_measures_drafting_only_in_rounds_that_hold_drafts() -> None:
    """A drafted round in which nothing was proposed does a plain round's work: counted as drafted, it pulls the
    drafted rate toward plain's, and the 5% margin is decided by noise. The drafted stretch waits for rounds with
    holds."""
    engine, _ = make("model", guard=True)
    assert engine.guard is not None and engine.drafter is not None
    silent = [True]
    propose = engine.drafter.propose

    def quiet_at_first(lanes, depths):  # type: ignore[no-untyped-def]
        return [[] for _ in lanes] if silent[0] else propose(lanes, depths)

    engine.drafter.propose = quiet_at_first  # type: ignore[method-assign]
    engine.submit([1 + (i * i) % 40 for i in range(20)], max_tokens=200, stop_token_ids=None)
    entry = engine.guard.entry(1)
    while entry.mode == "plain":
        engine.step()
    for _ in range(10):  # drafted mode, nothing proposed: the stretch neither advances nor measures
        engine.step()
    assert (entry.mode, entry.running, entry.left, entry.tokens, entry.seconds) == ("drafted", False, 4, 0, 0.0)
    silent[0] = False
    engine.step()  # its drafts were proposed while silent: still nothing held
    assert entry.left == 4
    holds = engine.stats().holds
    engine.step()
    assert engine.stats().holds > holds
    assert entry.left == 3 and entry.tokens >= 1 and entry.seconds > 0
