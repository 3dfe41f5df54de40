"""Prefix caching (`moelane.lanes.prefix`): a request that starts with the tokens of a finished stream takes over its
KV cache and feeds only the rest, and its reply is still the one-token decode of its prompt alone, to the bit (each
token's log-probability equals an engine's that keeps nothing): conversations, edited messages, capacities that must
not be mixed, prompt log-probabilities, compiled and paged targets, other families, threads, the shipped model.
The store's bounds and what is kept after a cancel or an error: `test_prefix_bounds.py`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

import moelane
from moelane.lanes import Engine, EngineConfig
from moelane.lanes.drafters import ModelDrafter
from moelane.lanes.prefix import interchangeable
from moelane.model.sampling import SamplingParams
from tests.helpers import random_model
from tests.lanes.prefix_helpers import (
    GREEDY,
    SAMPLED,
    Counted,
    check_same,
    config_of,
    conversation,
    cut_short,
    run,
    tiny_model,
    tokens,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def draft(tiny: Any) -> Any:
    return moelane.load(tiny.folder)  # the model itself, as a draft model: its drafts land


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["none", "model", "copy"])
def test_a_conversation_reuses_its_history_and_replies_as_alone(tiny, draft, params, drafter: str) -> None:
    """Four turns, each resending the history and a new message: from the second on, the stream takes over the
    previous turn's cache, feeds only the new tokens, and replies bit for bit as with nothing kept. The draft model
    keeps its caches too: it feeds only the new message and the last tokens it had not seen."""
    config = config_of(drafter)
    target, draft = Counted(tiny), Counted(draft)
    engine = Engine(target, EngineConfig(**config), draft=draft)
    history: list[int] = []
    n_cached = n_prompts = 0
    for turn in range(4):
        prompt = history + tokens(30, tiny.vocab_size, turn)
        target.n_prompt_rows = draft.n_prompt_rows = 0
        stream = run(engine, prompt, 16, params)
        if drafter == "model":
            # (its cache lags a few tokens behind the stream's, and catch-ups past the prompt count in too)
            assert draft.n_prompt_rows <= len(prompt) - len(history) + 8
        # the previous reply's last token is in the cache only if a round fed it (a stop, or drafts past the end)
        assert stream.n_cached in ((len(history) - 1, len(history)) if turn else (0,))
        assert target.n_prompt_rows == len(prompt) - stream.n_cached
        check_same(tiny, stream, 16, params, draft.lm, **config)
        history = prompt + stream.token_ids
        n_cached, n_prompts = n_cached + stream.n_cached, n_prompts + len(prompt)
    stats = engine.stats()
    assert stats.prefix_hits == 3 and stats.prefix_tokens == n_cached > 3 * 40
    assert stats.prefill_tokens == n_prompts - n_cached
    if drafter == "model":
        assert isinstance(engine.drafter, ModelDrafter) and engine.drafter.kept.n_hits == 3


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_prompt_sharing_part_of_a_kept_one_feeds_from_where_they_part(tiny, params: SamplingParams) -> None:
    """An edited last message: the kept cache holds the common part and stale rows after it, which the new prompt
    overwrites."""
    engine = Engine(tiny, EngineConfig(**config_of("copy")))
    first = run(engine, tokens(60, tiny.vocab_size, 1), 16, params)
    prompt = first.prompt_ids[:45] + tokens(20, tiny.vocab_size, 2)
    second = run(engine, prompt, 16, params)
    assert second.n_cached == 45 and engine.stats().prefix_hits == 1
    check_same(tiny, second, 16, params, **config_of("copy"))


@pytest.mark.slow  # (~7 s: the fast loop runs near its 3 minutes in a fresh clone)
def test_reuse_is_refused_where_the_capacities_read_attention_otherwise(tiny) -> None:
    """A cache of 256 positions is read whole, one of 512 in blocks of 512 keys: other kernels, other bits. A cache
    of 1,024 serves a stream that would get 768 (both read in blocks); one of 512 too small for a stream's reply has
    its rows copied into the stream's cache of 1,024."""
    config = config_of("none")
    engine = Engine(tiny, EngineConfig(**config))
    short = run(engine, tokens(60, tiny.vocab_size, 3), 16, GREEDY)  # capacity 256
    longer = short.prompt_ids + short.token_ids + tokens(20, tiny.vocab_size, 4)
    assert tiny.capacity_for(len(longer), 300) == 512 and not interchangeable(256, 512)
    refused = run(engine, longer, 300, GREEDY)
    assert refused.n_cached == 0 and engine.stats().prefix_hits == 0
    check_same(tiny, refused, 300, GREEDY, **config)
    # kept now: a cache of 512 holding `longer` and its reply; cancelled after 16 tokens, a stream of 1,024 keeps it
    big = cut_short(engine, tokens(100, tiny.vocab_size, 5), 900)
    assert big.finish_reason == "cancelled" and tiny.capacity_for(100, 900) == 1024
    follow = big.prompt_ids + big.token_ids + tokens(20, tiny.vocab_size, 6)
    assert tiny.capacity_for(len(follow), 500) == 768
    stream = cut_short(engine, follow, 500)
    assert stream.n_cached >= len(big.prompt_ids) + len(big.token_ids) - 1 and engine.stats().prefix_hits == 1
    fresh = cut_short(Engine(tiny, EngineConfig(**{**config, "prefix_cache_mb": 0})), follow, 500)
    n = min(len(fresh.token_ids), len(stream.token_ids))
    assert [(x.token_id, x.logprob) for x in stream.logprobs[:n]] == [
        (x.token_id, x.logprob) for x in fresh.logprobs[:n]
    ]
    alone = tiny.generate_ids(follow, 500)
    assert stream.token_ids == [next(alone) for _ in stream.token_ids]

    small = cut_short(engine, tokens(200, tiny.vocab_size, 7), 300)
    assert small.n_cached == 0 and engine.prefixes._kept[-1].cache.capacity == 512
    grown = small.prompt_ids + small.token_ids + tokens(400, tiny.vocab_size, 8)
    assert tiny.capacity_for(len(grown), 100) == 768
    copied = run(engine, grown, 100, GREEDY)
    assert copied.n_cached >= len(small.prompt_ids) + len(small.token_ids) - 1 and engine.stats().prefix_hits == 2
    check_same(tiny, copied, 100, GREEDY, **config)


def test_a_request_for_prompt_logprobs_feeds_its_whole_prompt(tiny) -> None:
    engine = Engine(tiny, EngineConfig(**config_of("none")))
    first = run(engine, tokens(40, tiny.vocab_size, 7), 8, GREEDY)
    prompt = first.prompt_ids + first.token_ids + tokens(10, tiny.vocab_size, 8)
    second = run(engine, prompt, 8, GREEDY, prompt_logprobs=True)
    assert second.n_cached == 0 and engine.stats().prefix_hits == 0
    assert len(second.prompt_logprobs) == len(prompt) and second.prompt_logprobs[0] is None


@pytest.mark.slow  # (compiles; the eager prefix tests stay fast)
def test_a_compiled_target_keeps_only_its_prompt_rows(tiny) -> None:
    """Generated rows through the compiled step have other bits than eager prompt rows: a compiled target's kept
    cache holds only the prompt, and replies equal the compiled solo decode and an engine that keeps nothing."""
    lm = moelane.load(tiny.folder, compile=True)
    assert lm.warm_up(8, 16)
    config = config_of("copy")
    engine = Engine(lm, EngineConfig(**config))
    streams = conversation(engine, lm.vocab_size, 3, SAMPLED)
    for before, stream in itertools.pairwise(streams):
        assert stream.n_cached == len(before.prompt_ids)
    for stream in streams:
        check_same(lm, stream, 16, SAMPLED, **config)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("gpt_oss", dict(sliding_window=6)), ("deepseek_v3", dict(rope_interleave=False)), ("lfm2_moe", {})],
)
def test_families_whose_cache_is_not_plain_kv_reuse_it(family: str, overrides: dict, tmp_path: Path) -> None:
    """Sinks and sliding windows (gpt-oss), latent attention (DeepSeek-V3), convolutions reading their inputs by
    position from the cache (LFM2): a conversation's turns reuse the cache and reply as alone."""
    lm = moelane.load(random_model(family, tmp_path / family, **overrides))
    config = config_of("copy")
    engine = Engine(lm, EngineConfig(**config))
    for params in (GREEDY, SAMPLED):
        for stream in conversation(engine, lm.vocab_size, 3, params):
            check_same(lm, stream, 16, params, **config)
    assert engine.stats().prefix_hits == 4


def test_a_threaded_engine_with_overlap_reuses_caches(tiny) -> None:
    """Admission (and adoption) runs during the previous pass with `overlap`; the engine's own thread runs rounds."""
    config = dict(config_of("copy"), overlap=True)
    engine = Engine(tiny, EngineConfig(**config))
    history: list[int] = []
    with engine:
        for turn in range(3):
            side = engine.submit(tokens(40, tiny.vocab_size, 200 + turn), 12)  # another stream in the rounds
            stream = engine.submit(history + tokens(30, tiny.vocab_size, 300 + turn), 16, logprobs=2)
            assert stream.wait(60) and side.wait(60)
            assert (stream.n_cached > 0) == (turn > 0)
            check_same(tiny, stream, 16, GREEDY, **config)
            history = stream.prompt_ids + stream.token_ids


@pytest.fixture(scope="module")
def shipped() -> Any:
    try:
        return moelane.load()
    except Exception as e:  # the shipped model is not in this checkout
        pytest.skip(f"no shipped model: {e}")


MESSAGES = [
    "You are a helpful assistant. The user writes about trains, rivers and the weather in the mountains.",
    "Tell me about the river that runs past the old mill, and what the trains carried along it.",
    "And in winter? Does the snow close the line, or do they keep it open with ploughs?",
]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["none", "copy"])
def test_the_shipped_model_replies_as_alone_across_turns(shipped, params: SamplingParams, drafter: str) -> None:
    config = config_of(drafter)
    engine = Engine(shipped, EngineConfig(**config))
    history: list[int] = []
    for message in MESSAGES:
        stream = run(engine, history + shipped.tokenizer.encode(message), 24, params)
        check_same(shipped, stream, 24, params, **config)
        history = stream.prompt_ids + stream.token_ids
    assert engine.stats().prefix_hits == 2


def test_a_paged_target_reuses_caches(tiny) -> None:
    """With half the experts paged (an expert store evicting and loading as rounds route), turns still reuse the
    history and reply as an engine keeping nothing on the same store."""
    from moelane.pager.live.build import store_factory
    from moelane.pager.live.memory import parse_memory

    lm = moelane.load(tiny.folder, provider=store_factory(parse_memory("50%")))
    config = config_of("copy")
    engine = Engine(lm, EngineConfig(**config))
    streams = conversation(engine, lm.vocab_size, 3, SAMPLED)
    assert engine.stats().prefix_hits == 2
    for stream in streams:
        check_same(lm, stream, 16, SAMPLED, **config)
    lm.close()


# (copy: 8 s, the fast set's longest test: in the slow set)
@pytest.mark.parametrize("drafter", [pytest.param("copy", marks=pytest.mark.slow), "recall"])
def test_many_streams_sharing_prefixes_in_waves_reply_as_alone(tiny, drafter: str) -> None:
    """Three conversations, then nine follow-ups of them at once, four streams a round: a follow-up takes a kept cache
    if it is there and fits (capacities 256 and 512 mixed), or prefills beside those that did; a few edit the last
    message, one is cancelled midway and kept. Every reply is its solo decode."""
    engine = Engine(tiny, EngineConfig(**config_of(drafter), max_streams=4))
    bases = [engine.submit(tokens(60, tiny.vocab_size, 400 + i), 16) for i in range(3)]
    engine.run_until_idle()
    follow: list[tuple[list[int], int]] = []
    for i, base in enumerate(bases):
        history = base.prompt_ids + base.token_ids
        follow += [(history + tokens(20, tiny.vocab_size, 500 + i), 16),
                   (history[:50] + tokens(30, tiny.vocab_size, 600 + i), 16),
                   (history + tokens(40, tiny.vocab_size, 700 + i), 300)]  # fmt: skip
    streams = [engine.submit(p, n) for p, n in follow]
    cancelled = streams[4]
    while len(cancelled.token_ids) < 4:
        engine.step()
    cancelled.cancel()
    engine.run_until_idle()
    assert engine.stats().prefix_hits >= 2  # (base 2's cache may be gone: four are kept, the newest)
    for stream, (prompt, n) in zip(streams, follow, strict=True):
        alone = list(tiny.generate_ids(prompt, n))
        assert stream.token_ids == (alone if stream is not cancelled else alone[: len(stream.token_ids)])
