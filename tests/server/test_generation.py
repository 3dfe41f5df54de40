"""`Generation` over a scripted engine: stop strings cut the text exactly where the reference cut (the first
occurrence in the whole reply) however tokens group into rounds, and the engine stream is cancelled at a stop. The
`Handoff` over the lanes engine: every stream's tokens arrive whole and in order, with one wake-up of the loop per
engine step at most."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from moelane.lanes import Engine, EngineConfig
from moelane.lanes.fake import FakeTarget
from moelane.model.tokenizer import Tokenizer
from moelane.server.generation import END, Generation, GenerationParams, Handoff, Limits, RequestTimeout
from tests.helpers import TEXT, write_tokenizer
from tests.server.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, 300)
    return Tokenizer(folder, frozenset())


def run(engine: FakeEngine, tok: Tokenizer, stops: tuple[str, ...], max_tokens: int = 200,
        limits: Limits | None = None) -> tuple[str, Generation]:  # fmt: skip
    gen = Generation(engine, tok, GenerationParams((1, 2), max_tokens, stops=stops),
                     limits or Limits())  # fmt: skip

    async def collect() -> str:
        return "".join([p async for p in gen.run()])

    return asyncio.run(collect()), gen


@pytest.mark.parametrize("per_round", [1, 3, 8, 64])
def test_stop_cut_matches_reference_for_any_round_grouping(tokenizer: Tokenizer, per_round: int) -> None:
    reply = tokenizer.encode(TEXT[:160])
    full = tokenizer.decode(reply)
    for start, length in [(3, 1), (10, 2), (17, 5), (40, 9), (90, 3), (120, 12), (150, 4)]:
        stop = full[start : start + length]
        text, gen = run(FakeEngine(reply, per_round), tokenizer, (stop, "\x00absent"))
        assert text == full[: full.index(stop)], (stop, per_round)
        assert gen.finish_reason == "stop"
        assert tokenizer.decode(reply[: gen.n_tokens]).find(stop) >= 0  # counted up to the stop, no further
        assert stop not in tokenizer.decode(reply[: gen.n_tokens - 1])


def test_no_stop_gives_the_whole_reply_and_the_engine_reason(tokenizer: Tokenizer) -> None:
    reply = tokenizer.encode(TEXT[:80])
    text, gen = run(FakeEngine(reply, 4), tokenizer, (), max_tokens=len(reply))
    assert text == tokenizer.decode(reply) and gen.finish_reason == "length" and gen.n_tokens == len(reply)


def test_stop_cancels_the_engine_stream(tokenizer: Tokenizer) -> None:
    reply = tokenizer.encode(TEXT)
    engine = FakeEngine(reply, 1, delay=0.01)
    run(engine, tokenizer, (tokenizer.decode(reply)[5:9],))
    stream = engine.streams[0]
    assert stream.cancel_requested and stream.wait(5) and stream.finish_reason == "cancelled"


def test_idle_timeout(tokenizer: Tokenizer) -> None:
    engine = FakeEngine(tokenizer.encode(TEXT[:40]), 1, delay=0.5)
    with pytest.raises(RequestTimeout, match="idle"):
        run(engine, tokenizer, (), limits=Limits(request_s=10, idle_s=0.1))
    assert engine.streams[0].wait(5) and engine.streams[0].finish_reason == "cancelled"


def test_handoff_wakes_the_loop_once_a_step_and_loses_nothing(tokenizer: Tokenizer) -> None:
    """Generations over a started lanes engine, through a `Handoff` flushed by its step hook: each reply is the
    engine stream's tokens, and the loop is woken at most once per engine step (plus once per listener's first call,
    made on the loop), where a wake-up per commit took one per stream per round."""
    engine = Engine(FakeTarget(300, window=1), EngineConfig(timed=False, drafter="none"))
    steps, wakes = [0], [0]
    lock = threading.Lock()

    def count_step() -> None:
        with lock:
            steps[0] += 1

    async def main() -> list[tuple[str, Any]]:
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop, engine.on_engine_thread)
        drain = handoff._drain

        def counted_drain() -> None:
            wakes[0] += 1
            drain()

        handoff._drain = counted_drain  # type: ignore[method-assign]
        engine.add_step_hook(handoff.flush)
        engine.add_step_hook(count_step)
        params = [GenerationParams((1 + i, 2, 3), 24 + 3 * i) for i in range(5)]
        gens = [Generation(engine, tokenizer, p, Limits(), handoff=handoff) for p in params]

        async def reply(gen: Generation) -> tuple[str, Any]:
            return "".join([p async for p in gen.run()]), gen.stream

        with engine:
            return await asyncio.gather(*(reply(g) for g in gens))

    replies = asyncio.run(main())
    for text, stream in replies:
        assert stream.finish_reason == "length" and text == tokenizer.decode(stream.token_ids)
    n_commits = sum(len(stream.token_ids) for _, stream in replies)
    assert wakes[0] <= steps[0] + len(replies), (wakes, steps)
    assert wakes[0] < n_commits / 2, (wakes, n_commits)


def test_handoff_holds_puts_until_flushed_in_order() -> None:
    """Held puts (on the engine thread during a step) wait for `flush`, then arrive in order; an unheld put wakes the
    loop by itself; a flush with nothing pending schedules nothing."""
    held = [True]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop, lambda: held[0])
        a: asyncio.Queue[list[int] | None] = asyncio.Queue()
        b: asyncio.Queue[list[int] | None] = asyncio.Queue()
        handoff.put(a, [1])
        handoff.put(b, [2])
        handoff.put(a, END)
        await asyncio.sleep(0.01)
        assert a.empty() and b.empty()
        handoff.flush()
        await asyncio.sleep(0.01)
        assert [a.get_nowait(), a.get_nowait(), b.get_nowait()] == [[1], END, [2]]
        handoff.flush()
        assert not loop._ready  # type: ignore[attr-defined]  # (nothing pending: no wake-up)
        held[0] = False
        handoff.put(b, [3])
        await asyncio.sleep(0.01)
        assert b.get_nowait() == [3]

    asyncio.run(main())
