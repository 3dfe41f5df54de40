"""`Generation` over a scripted engine: stop strings cut the text exactly where the reference cut (the first
occurrence in the whole reply) however tokens group into rounds, and the engine stream is cancelled at a stop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from moelane.model.tokenizer import Tokenizer
from moelane.server.generation import Generation, GenerationParams, Limits, RequestTimeout
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
