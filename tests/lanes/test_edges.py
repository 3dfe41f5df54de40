"""The lanes engine at the edges its users reach: how it calls a real `LM`, settings and arguments of the wrong type,
streams cancelled while they wait, draft models that cannot hold a stream. Tiny models; every wait has a timeout."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import moelane
import moelane.lanes.engine as engine_module
from moelane.errors import InputError
from moelane.lanes import Engine, EngineConfig
from moelane.lanes.fake import FakeCache, FakeTarget
from moelane.model.provider import RoutingRecord
from moelane.model.sampling import SamplingParams
from tests.helpers import random_model
from tests.lanes.reference import prompts, solo_decode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return moelane.load(random_model("qwen3_moe", tmp_path_factory.mktemp("lanes_edges") / "target"))


class Phases:
    def __init__(self) -> None:
        self.phases: list[object] = []

    def observe(self, record: RoutingRecord) -> None:
        self.phases.append(record.phase)


def test_plain_rounds_ask_the_lm_for_last_rows_only(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`last_only` reaches `LM.forward` as itself (its second parameter is `phase`): plain rounds get one row of
    logits per stream, and routing observers get a phase, not a flag."""
    shapes: list[list[int]] = []
    forward = tiny.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        shapes.append([lg.shape[0] for lg in out])
        return out

    monkeypatch.setattr(tiny, "forward", recording)
    observer = Phases()
    monkeypatch.setattr(tiny, "observers", [observer])
    engine = Engine(tiny, EngineConfig(timed=False, max_streams=3))
    streams = [engine.submit(p, 4) for p in prompts(3, tiny.vocab_size)]
    engine.run_until_idle()
    assert all(s.finish_reason == "length" for s in streams)
    assert shapes and all(n == 1 for pass_shapes in shapes for n in pass_shapes), shapes
    assert observer.phases and set(observer.phases) <= {"prefill", "decode", "mixed"}, observer.phases


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (dict(timed="no"), "timed must be True or False"),  # (a truthy string would turn it on)
        (dict(overlap=1), "overlap must be True or False"),
        (dict(guard="off"), "guard must be True or False"),
        (dict(compile_draft=None), "compile_draft must be True or False"),
        (dict(prices=5), "prices must be (rows, cost) pairs"),
        (dict(prices=((1,),)), "prices must be (rows, cost) pairs"),
        (dict(prices=((1, "x"),)), "prices cost must be a finite number"),
    ],
)
def test_config_of_the_wrong_type_is_refused_in_one_line(setting: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**setting)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(grammar="json"), "grammar must be a moelane.model.grammar.Grammar"),
        (dict(grammar={"type": "object"}), "grammar must be a moelane.model.grammar.Grammar"),
        (dict(prompt_logprobs="no", logprobs=1), "prompt_logprobs must be True or False"),
    ],
)
def test_submit_refuses_arguments_of_the_wrong_type(arguments: dict[str, Any], message: str) -> None:
    engine = Engine(FakeTarget(32), EngineConfig(timed=False))
    with pytest.raises(InputError, match=re.escape(message)):
        engine.submit([1, 2, 3], 4, **arguments)
    assert engine.n_waiting == 0


def test_a_stream_cancelled_while_it_waits_ends_at_the_next_round() -> None:
    """A queued stream cancelled while every seat is taken ends then (a client that went away is not kept until a
    seat frees); the stream holding the seat goes on."""
    engine = Engine(FakeTarget(32, window=1), EngineConfig(timed=False, max_streams=1))
    running = engine.submit([1, 2, 3], 50)
    queued = [engine.submit([4, 5], 5) for _ in range(3)]
    engine.step()
    queued[1].cancel()
    engine.step()
    assert queued[1].finish_reason == "cancelled" and engine.n_waiting == 2
    assert running.finish_reason is None and not queued[0].done
    assert engine.stats().finished == 1  # (counted as every stream that ended)
    engine.run_until_idle()
    assert [s.finish_reason for s in (running, queued[0], queued[2])] == ["length"] * 3
    assert engine.stats().finished == 4


class ShortDraft(FakeTarget):
    """A draft model of a shorter context than the target's: as `LM`, its caches stop at its context and a prompt
    that fills it is refused."""

    def __init__(self, vocab_size: int, max_context: int, **kwargs: Any) -> None:
        super().__init__(vocab_size, **kwargs)
        self.max_context = max_context

    def capacity_for(self, n_prompt: int, max_tokens: int) -> int:
        if n_prompt >= self.max_context:
            raise InputError(f"prompt of {n_prompt} tokens does not fit the model's context of {self.max_context}")
        return min(n_prompt + max_tokens, self.max_context)

    def cache_for(self, n_prompt: int, max_tokens: int) -> FakeCache:
        return FakeCache(self.capacity_for(n_prompt, max_tokens))


@pytest.mark.parametrize("overlap", [False, True])
def test_a_draft_model_of_a_shorter_context_drafts_only_what_it_holds(overlap: bool) -> None:
    """Streams longer than the draft model's context (a prompt past it, or a reply that runs past it) are served
    as without drafts where the draft model cannot follow: same replies, none ends "error"."""
    target = FakeTarget(32, window=1)
    draft = ShortDraft(32, 24, window=1, error_rate=0.2)
    engine = Engine(target, EngineConfig(drafter="model", timed=False, overlap=overlap), draft=draft)
    cases = [([1, 2, 3], 40), ([5, 6, 7] * 10, 12), ([4] * 23, 6), ([9, 8], 8)]
    streams = [engine.submit(prompt, n) for prompt, n in cases]
    engine.run_until_idle()
    for stream, (prompt, n) in zip(streams, cases, strict=True):
        assert (stream.finish_reason, stream.error) == ("length", None)
        assert stream.token_ids == solo_decode(target, prompt, n, SamplingParams())
    assert engine.stats().accepted > 0


def test_a_stream_cancelled_during_an_overlapped_pass_gets_no_tokens_after_it_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `overlap`, newcomers are admitted while a pass runs; a stream of that pass cancelled meanwhile ends once,
    after it, and no token reaches it (nor its listener) after its end."""
    engine = Engine(FakeTarget(32, window=1), EngineConfig(timed=False, overlap=True, max_streams=3))
    victim, other = engine.submit([1, 2, 3], 20), engine.submit([4, 5, 6], 8)
    events: list[object] = []
    victim.subscribe(lambda tokens: events.append(tokens if tokens is None else len(tokens)))
    plan = engine_module.plan_windows

    def cancelling(*args: Any, **kwargs: Any) -> Any:  # (after the round's streams are chosen, before its pass)
        if engine.stats().rounds == 3:
            victim.cancel()
            engine.submit([7, 8], 4)  # (a newcomer to admit during the pass)
        return plan(*args, **kwargs)

    monkeypatch.setattr(engine_module, "plan_windows", cancelling)
    engine.run_until_idle()
    assert victim.finish_reason == "cancelled" and other.finish_reason == "length"
    assert events[-1] is None and None not in events[:-1], events
    assert sum(n for n in events if n is not None) == len(victim.token_ids)
    assert engine.stats().finished == 3


def test_a_timed_engine_serves_a_model_of_a_context_shorter_than_its_calibration(tmp_path: Path) -> None:
    """Calibration measures passes only as wide as the model's context holds (it asked a context of 24 for a cache
    of 64 positions: InputError from `Engine(...)`)."""
    lm = moelane.load(random_model("qwen3_moe", tmp_path / "short", max_position_embeddings=24))
    engine = Engine(lm, EngineConfig(drafter="copy"))
    stream = engine.submit([1, 2, 3] * 7, 10)
    engine.run_until_idle()
    assert stream.token_ids == list(lm.generate_ids([1, 2, 3] * 7, 10))


def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "moelane-lanes"}


def test_starts_racing_each_other_run_one_engine_thread() -> None:
    """`start()` from several threads while a stop asked on the engine thread is under way runs one engine thread
    after it: each ran one, and they ran rounds over the same streams (other tokens, shared caches, "error")."""
    before = engine_threads()
    engine = Engine(FakeTarget(32, window=1), EngineConfig(timed=False))
    engine.start()
    asked, release = threading.Event(), threading.Event()

    def stopping(tokens: list[int] | None) -> None:
        if tokens and not asked.is_set():
            engine.stop()  # (asked on the engine thread: it ends the streams after this round)
            asked.set()
            release.wait(10)

    engine.submit([1, 2, 3], 50).subscribe(stopping)
    assert asked.wait(10)
    starters = [threading.Thread(target=engine.start) for _ in range(6)]
    for t in starters:
        t.start()
    time.sleep(0.1)  # (the starters find the stopping thread, and wait for it)
    release.set()
    for t in starters:
        t.join(10)
    assert len(engine_threads() - before) == 1
    stream = engine.submit([1, 2, 3], 5)
    assert stream.wait(10) and stream.token_ids == solo_decode(engine.target, [1, 2, 3], 5, SamplingParams())
    engine.stop()
    assert not engine_threads() - before


def test_start_on_the_engine_thread_after_a_stop_asked_there_goes_on() -> None:
    """A listener's `stop()` then `start()` (both on the engine thread) leaves the engine running: no join of the
    thread by itself (RuntimeError, logged as the listener's)."""
    engine = Engine(FakeTarget(32, window=1), EngineConfig(timed=False))
    with engine:
        stream = engine.submit([1, 2, 3], 6)
        restarted: list[bool] = []

        def listener(tokens: list[int] | None) -> None:
            if tokens and not restarted:
                engine.stop()
                engine.start()
                restarted.append(True)

        stream.subscribe(listener)
        assert stream.wait(10) and restarted
        assert stream.finish_reason == "length"
        later = engine.submit([4, 5], 3)
        assert later.wait(10) and later.finish_reason == "length"


def test_the_draft_model_drafts_with_prompt_chunks_of_one_token() -> None:
    """`prefill_chunk=1`: the draft model still catches up with each round's two new tokens and drafts (it fed
    one token a round, ended each round a token behind, and never drafted)."""
    target = FakeTarget(32, window=1)
    draft = FakeTarget(32, window=1, error_rate=0.2)
    engine = Engine(target, EngineConfig(drafter="model", timed=False, prefill_chunk=1), draft=draft)
    cases = [([1, 2, 3], 30), ([5, 6, 7, 8], 20)]
    streams = [engine.submit(prompt, n) for prompt, n in cases]
    engine.run_until_idle()
    for stream, (prompt, n) in zip(streams, cases, strict=True):
        assert stream.token_ids == solo_decode(target, prompt, n, SamplingParams())
    assert engine.stats().accepted > 10


def test_an_engine_refuses_settings_that_are_not_an_engine_config() -> None:
    with pytest.raises(ValueError, match=re.escape("config must be an EngineConfig")):
        Engine(FakeTarget(32), {"drafter": "copy"})  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", [[True, 2], (1, False), iter([3, True])])
def test_a_prompt_of_bools_is_refused(prompt: Any) -> None:
    engine = Engine(FakeTarget(32), EngineConfig(timed=False))
    with pytest.raises(InputError, match="token ids must be integers, not bools"):
        engine.submit(prompt, 4)


def test_a_prompt_from_an_iterator_is_taken() -> None:
    engine = Engine(FakeTarget(32, window=1), EngineConfig(timed=False))
    stream = engine.submit(iter([1, 2, 3]), 4)
    engine.run_until_idle()
    assert stream.prompt_ids == [1, 2, 3] and stream.token_ids == solo_decode(
        engine.target, [1, 2, 3], 4, SamplingParams()
    )


class FailingDraft(FakeTarget):
    """A draft model whose passes fail from its `after`-th on (a bug, a device gone)."""

    def __init__(self, vocab_size: int, after: int, **kwargs: Any) -> None:
        super().__init__(vocab_size, **kwargs)
        self.after, self.passes = after, 0

    def forward(self, rows: Any, last_only: bool = False) -> Any:
        self.passes += 1
        if self.passes > self.after:
            raise RuntimeError("draft pass failed")
        return super().forward(rows, last_only=last_only)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("after", [0, 6])
def test_a_failing_drafter_costs_drafts_not_streams(
    overlap: bool, after: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Drafts never change a reply, so a drafter that fails (at once, or after some drafting) leaves its streams
    without drafts: every reply is the solo decode's and ends "length" (a failure in `propose` failed the round,
    and, failing again in each stream's rerun, ended every stream "error"); its first failure is logged whole."""
    # (`moelane run` quiets this logger in its process; a test that ran it in this one must not hide the record)
    caplog.set_level(logging.ERROR, logger="moelane.lanes.engine")
    target = FakeTarget(32, window=1)
    draft = FailingDraft(32, after, window=1, error_rate=0.2)
    engine = Engine(target, EngineConfig(drafter="model", timed=False, overlap=overlap, max_streams=2), draft=draft)
    cases = [([1, 2, 3], 20), ([5, 6, 7, 8], 16), ([9, 8], 12)]
    streams = [engine.submit(prompt, n) for prompt, n in cases]
    engine.run_until_idle()
    for stream, (prompt, n) in zip(streams, cases, strict=True):
        assert (stream.finish_reason, stream.error) == ("length", None)
        assert stream.token_ids == solo_decode(target, prompt, n, SamplingParams())
    assert draft.passes > after
    assert sum("drafter failed; the streams" in r.getMessage() for r in caplog.records) == 1
