"""The engine's Python API at its edges, against the fake target: arguments checked at submit, a stream that cannot be
admitted, the threaded engine's start / stop (from any thread, the engine's own included, racing submissions), and
errors between rounds. Every wait has a timeout: a stranded stream fails a test instead of hanging it."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from moelane.errors import InputError, MoelaneError
from moelane.lanes import Engine, EngineConfig
from moelane.lanes.fake import FakeTarget
from moelane.model.sampling import SamplingParams
from tests.lanes.reference import solo_decode

VOCAB = 48
UNADMITTABLE = 13  # max_tokens for which FlakyCacheTarget cannot allocate a cache


class FlakyCacheTarget(FakeTarget):
    """Fails to allocate the cache of a stream that asks for UNADMITTABLE tokens (as a pool out of memory would)."""

    def cache_for(self, n_prompt: int, max_tokens: int) -> Any:
        if max_tokens == UNADMITTABLE:
            raise RuntimeError("no cache for this stream (test)")
        return super().cache_for(n_prompt, max_tokens)


def engine_of(target: FakeTarget | None = None, **config: Any) -> Engine:
    return Engine(target or FakeTarget(VOCAB, window=1), EngineConfig(timed=False, **config))


def all_end(streams: list[Any], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    return all(s.wait(max(0.0, deadline - time.monotonic())) for s in streams)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_stream_that_cannot_be_admitted_ends_alone(threaded: bool) -> None:
    """Its cache allocation fails: it ends "error" with that exception; the streams beside it go on as if alone."""
    engine = engine_of(FlakyCacheTarget(VOCAB, window=1))
    good = engine.submit([1, 2, 3], max_tokens=1000)
    if threaded:
        engine.start()
        while len(good.token_ids) < 3:  # running when the next stream fails to join
            good.wait(0.001)
    bad = engine.submit([4, 5], max_tokens=UNADMITTABLE)
    later = engine.submit([6, 7], max_tokens=20)
    if threaded:
        assert all_end([good, bad, later])
        engine.stop()
    else:
        engine.run_until_idle()
    assert bad.finish_reason == "error" and isinstance(bad.error, RuntimeError) and bad.token_ids == []
    reference = FakeTarget(VOCAB, window=1)
    for stream, n in ((good, 1000), (later, 20)):
        assert stream.finish_reason == "length" and stream.error is None
        assert stream.token_ids == solo_decode(reference, stream.prompt_ids, n, SamplingParams())
    assert engine.n_active == engine.n_waiting == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(max_tokens=700.0), "max_tokens must be an integer"),
        (dict(max_tokens=True), "max_tokens must be an integer"),
        (dict(max_tokens=None), "max_tokens must be an integer"),
        (dict(seed=1.5, temperature=0.7), "seed must be an integer"),
        (dict(seed="x", temperature=0.7), "seed must be an integer"),
        (dict(top_k=2.5, temperature=0.7), "top_k must be an integer"),
        (dict(logprobs=2.5), "logprobs must be an integer"),
        (dict(logprobs=True), "logprobs must be an integer"),
        (dict(logit_bias={1.5: 10.0}), "logit_bias token id must be an integer"),
        (dict(logit_bias={True: 10.0}), "logit_bias token id must be an integer"),
        (dict(logit_bias=[(1, 2.0)]), "logit_bias must be a mapping"),  # (AttributeError: no items)
        (dict(logit_bias={1: "2"}), "logit_bias values must be numbers"),
        (dict(temperature="0.5"), "temperature must be a number"),  # (TypeError from a comparison)
        (dict(stop_token_ids=5), "stop_token_ids must be a list"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids must be an integer"),
        (dict(stop_token_ids="12"), "stop_token_ids must be a list"),
        (dict(stop_token_ids={1: 2}), "stop_token_ids must be a list"),
        (dict(stop_token_ids=np.array([[1, 2]])), "stop_token_ids must be an integer"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be an integer"),
    ],
)
def test_submit_refuses_arguments_of_the_wrong_type(kwargs: dict[str, Any], message: str) -> None:
    engine = engine_of()
    with pytest.raises(InputError, match=f"^{message}"):
        engine.submit([1, 2], **kwargs)
    assert engine.n_waiting == 0


def test_numpy_integers_are_integers() -> None:
    engine = engine_of()
    kwargs = dict(max_tokens=7, temperature=0.8, top_k=5, seed=11, logprobs=2, logit_bias={3: 5.0})
    as_numpy = {k: np.int64(v) if isinstance(v, int) else v for k, v in kwargs.items()}
    as_numpy["logit_bias"] = {np.int32(3): 5.0}
    plain, numpy = engine.submit([1, 2], **kwargs), engine.submit([1, 2], **as_numpy)  # type: ignore[arg-type]
    engine.run_until_idle()
    assert numpy.token_ids == plain.token_ids and len(plain.token_ids) == 7
    assert [e.top for e in numpy.logprobs] == [e.top for e in plain.logprobs]


@pytest.mark.parametrize("collection", [np.array, torch.tensor, tuple, set, iter])
def test_stop_token_ids_may_be_any_collection_of_ids(collection: Any) -> None:
    """A numpy array or a tensor of ids (what a tokenizer may give), as a list of them (an array was refused)."""
    engine = engine_of()
    reference = engine.submit([1, 2], max_tokens=20)
    engine.run_until_idle()
    stops = [reference.token_ids[6], reference.token_ids[4]]
    as_list, as_other = (
        engine.submit([1, 2], 20, stop_token_ids=stops),
        engine.submit([1, 2], 20, stop_token_ids=collection(stops)),
    )
    engine.run_until_idle()
    end = min(i for i, t in enumerate(reference.token_ids) if t in stops)
    assert as_other.token_ids == as_list.token_ids == reference.token_ids[:end]
    assert as_other.finish_reason == as_list.finish_reason == "stop"


@pytest.mark.parametrize(
    "config",
    [
        dict(max_streams=float("nan")),
        dict(max_streams=2.5),
        dict(max_rows=256.0),
        dict(max_depth=True),
        dict(min_match=float("nan")),
        dict(draft_price=float("nan")),
        dict(draft_price=float("inf")),
        dict(prices=((1, float("nan")),)),
        dict(prices=((1.5, 1.0),)),
        dict(prices=((1, 0.0),)),
    ],
)
def test_engine_config_refuses_nan_and_non_integer_counts(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"^{next(iter(config))}"):
        EngineConfig(**config)


def test_engine_config_takes_numpy_counts_as_ints() -> None:
    config = EngineConfig(max_streams=np.int64(4), prices=((np.int32(1), np.float32(1.5)),))  # type: ignore[arg-type]
    assert type(config.max_streams) is int and config.prices == ((1, 1.5),)
    assert type(config.prices[0][0]) is int


def test_an_error_between_rounds_ends_the_streams_once_and_never_spins() -> None:
    """An error outside any one round (here: every admission raises) would fail again at once: the streams the
    engine holds end "error" with it, and the thread waits for new work instead of retrying in a loop."""
    engine = engine_of()
    calls = []

    def broken() -> list[Any]:
        calls.append(1)
        raise TypeError("broken between rounds (test)")

    engine._admit = broken  # type: ignore[method-assign]
    streams = [engine.submit([1, 2], max_tokens=5) for _ in range(3)]
    with engine:
        assert all_end(streams, 5)
        time.sleep(0.2)
        assert len(calls) == 1
        assert all(s.finish_reason == "error" and isinstance(s.error, TypeError) for s in streams)
        del engine._admit  # mended: the engine serves again
        again = engine.submit([1, 2], max_tokens=5)
        assert again.wait(5) and again.finish_reason == "length"


def test_submit_after_stop_is_refused_until_start() -> None:
    engine = engine_of()
    engine.stop()  # never started: nothing to stop, and step-driving goes on
    first = engine.submit([1, 2], max_tokens=3)
    engine.run_until_idle()
    assert first.finish_reason == "length"
    engine.start()
    engine.stop()
    with pytest.raises(MoelaneError, match="stopped"):
        engine.submit([1, 2], max_tokens=3)
    assert engine.n_waiting == 0
    with engine:
        again = engine.submit([1, 2], max_tokens=3)
        assert again.wait(5) and again.finish_reason == "length"


def test_submissions_racing_stop_all_end() -> None:
    """Streams submitted from other threads while stop() runs: each is refused, or ends (served or cancelled)."""
    engine = engine_of(max_streams=2)
    engine.start()
    submitted: list[Any] = []
    refused = threading.Event()
    give_up = time.monotonic() + 10

    def submit_until_refused() -> None:
        while time.monotonic() < give_up:
            try:
                submitted.append(engine.submit([1, 2], max_tokens=50))
            except MoelaneError:
                refused.set()
                return
            time.sleep(0.0005)

    threads = [threading.Thread(target=submit_until_refused) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    engine.stop()
    for t in threads:
        t.join(timeout=15)
    assert refused.is_set() and len(submitted) > 10
    assert all_end(submitted, 5)
    assert {s.finish_reason for s in submitted} <= {"length", "cancelled"}
    assert engine.n_active == engine.n_waiting == 0


def test_stop_from_a_listener_on_the_engine_thread() -> None:
    """stop() called on the engine thread asks for the stop: its streams end "cancelled" after the round, and the
    engine can be started again."""
    engine = engine_of(max_streams=1)
    with engine:
        running = engine.submit([1, 2], max_tokens=100_000)
        waiting = engine.submit([3, 4], max_tokens=5)
        running.subscribe(lambda tokens: engine.stop() if tokens else None)
        assert all_end([running, waiting], 5)
        assert running.finish_reason == waiting.finish_reason == "cancelled"
        with pytest.raises(MoelaneError, match="stopped"):
            engine.submit([1, 2], max_tokens=3)
        engine.start()
        again = engine.submit([1, 2], max_tokens=3)
        assert again.wait(5) and again.finish_reason == "length"


def test_rounds_are_not_run_from_a_second_thread_while_started() -> None:
    engine = engine_of()
    with engine:
        with pytest.raises(MoelaneError, match="stop\\(\\) it"):
            engine.step()
        with pytest.raises(MoelaneError, match="stop\\(\\) it"):
            engine.run_until_idle()
    assert engine.step() is False  # stopped: stepping is this thread's again


def test_with_engine_starts_and_stops_its_thread() -> None:
    with engine_of() as engine:
        thread = engine._thread
        stream = engine.submit([1, 2], max_tokens=4)
        assert stream.wait(5) and stream.finish_reason == "length"
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive() and engine._thread is None


def test_step_hooks_follow_each_round_s_commits_on_the_engine_thread() -> None:
    """Between two hook calls each stream commits at most once (one round's commits, then its hook); every listener
    call on the engine thread has a hook call after it, the streams' ends and a stop's cancellations included; a
    hook that raises stops nothing, and a removed hook is not called again."""
    engine = engine_of(drafter="none")
    events: list[tuple[str, int, bool]] = []
    lock = threading.Lock()

    def hook() -> None:
        with lock:
            events.append(("hook", -1, engine.on_engine_thread()))

    def failing() -> None:
        raise RuntimeError("a hook's bug (test)")

    engine.add_step_hook(failing)
    remove = engine.add_step_hook(hook)
    streams = [engine.submit([1 + i, 2], max_tokens=6 + i) for i in range(3)]
    for i, stream in enumerate(streams):

        def listener(tokens: list[int] | None, i: int = i) -> None:
            with lock:
                events.append(("end" if tokens is None else "commit", i, engine.on_engine_thread()))

        stream.subscribe(listener)
    with engine:
        assert all_end(streams)
        endless = engine.submit([4, 5], max_tokens=100_000)
        endless.subscribe(lambda tokens: listener(tokens, 9) if tokens is None else None)
        while not endless.token_ids:
            time.sleep(0.01)
    assert endless.finish_reason == "cancelled"
    assert [s.finish_reason for s in streams] == ["length"] * 3
    assert all(on_thread for _, _, on_thread in events)  # (subscribed before start: every call came from a step)
    assert events[-1][0] == "hook" and ("end", 9, True) in events
    groups: list[list[int]] = [[]]
    for kind, i, _ in events:
        if kind == "hook":
            groups.append([])
        elif kind == "commit":
            groups[-1].append(i)
    assert all(len(g) == len(set(g)) for g in groups), groups
    assert sum(len(g) > 1 for g in groups) > 0  # rounds of several streams did share a hook
    remove()
    n_hooks = sum(kind == "hook" for kind, _, _ in events)
    with engine:
        assert engine.submit([1, 2], max_tokens=3).wait(5)
    assert sum(kind == "hook" for kind, _, _ in events) == n_hooks
    assert not engine.on_engine_thread()
