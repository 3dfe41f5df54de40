"""Helpers of the prefix caching tests (`test_prefix.py`, `test_prefix_bounds.py`): tiny models, conversations, and
the check that a reply is its prompt's solo decode and, bit for bit, what an engine keeping nothing gives."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

import moelane
from moelane.lanes import Engine, EngineConfig
from moelane.lanes.request import submit_kwargs
from moelane.lanes.stream import Stream
from moelane.model.sampling import SamplingParams
from tests.helpers import random_model

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7)


def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random model with room for caches of 256 to 1,024 positions."""
    folder = random_model("qwen3_moe", tmp_path_factory.mktemp("prefix") / "m", max_position_embeddings=1024)
    return moelane.load(folder)


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (n,), generator=g).tolist()


def run(engine: Engine, prompt: list[int], max_tokens: int, params: SamplingParams, **kw: Any) -> Stream:
    stream = engine.submit(prompt, max_tokens, logprobs=2, **submit_kwargs(params), **kw)
    engine.run_until_idle()
    return stream


def check_same(lm: Any, stream: Stream, max_tokens: int, params: SamplingParams, draft: Any = None,
               **config: Any) -> None:  # fmt: skip
    """`stream`'s reply is its prompt's one-token decode alone, and its log-probabilities are bit for bit those of an
    engine that keeps no cache."""
    assert stream.token_ids == list(lm.generate_ids(stream.prompt_ids, max_tokens, params))
    fresh_engine = Engine(lm, EngineConfig(**{**config, "prefix_cache_mb": 0}), draft=draft)
    fresh = run(fresh_engine, stream.prompt_ids, max_tokens, params)
    assert fresh.token_ids == stream.token_ids
    assert [(x.token_id, x.logprob, x.top) for x in fresh.logprobs] == [
        (x.token_id, x.logprob, x.top) for x in stream.logprobs
    ]


def config_of(drafter: str) -> dict[str, Any]:
    return dict(drafter=drafter, timed=False, guard=False, prefill_chunk=24)


class Counted:
    """A target that counts the prompt rows (not generated ones) its passes feed."""

    def __init__(self, lm: Any) -> None:
        self.lm, self.n_prompt_rows = lm, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lm, name)

    def forward(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.n_prompt_rows += sum(len(r.token_ids) for r in rows if not r.decode)
        return self.lm.forward(rows, *args, **kwargs)


class Scarce(Counted):
    """A target with room for `room` caches at a time (as a pool out of memory)."""

    def __init__(self, lm: Any, room: int) -> None:
        super().__init__(lm)
        self.room, self.alive = room, weakref.WeakSet[Any]()

    def cache_for(self, n_prompt: int, max_tokens: int) -> Any:
        if len(self.alive) >= self.room:
            raise MemoryError("no room for another cache (test)")
        cache = self.lm.cache_for(n_prompt, max_tokens)
        self.alive.add(cache)
        return cache


def cut_short(engine: Engine, prompt: list[int], max_tokens: int, n: int = 16) -> Stream:
    """A stream cancelled once it has `n` tokens (or more: the round that gave them may have given more)."""
    stream = engine.submit(prompt, max_tokens, logprobs=2)
    while len(stream.token_ids) < n and not stream.done:
        engine.step()
    stream.cancel()
    engine.run_until_idle()
    return stream


def conversation(engine: Engine, vocab: int, n_turns: int, params: SamplingParams) -> list[Stream]:
    streams: list[Stream] = []
    history: list[int] = []
    for turn in range(n_turns):
        stream = run(engine, history + tokens(30, vocab, 100 + turn), 16, params)
        streams.append(stream)
        history = stream.prompt_ids + stream.token_ids
    return streams
