"""Prefix caching's bounds (`moelane.lanes.prefix`): what is kept after a cancel and after an error, at most
max_streams caches and prefix_cache_mb of their positions, live streams counted first, 0 bytes keeping nothing, and a
live stream's cache allocated even when kept ones are in the way."""

from __future__ import annotations

from typing import Any

import pytest

from moelane.lanes import Engine, EngineConfig
from moelane.lanes.fake import FakeTarget
from moelane.lanes.prefix import MIN_REUSE, PrefixStore
from tests.lanes.prefix_helpers import (
    GREEDY,
    Counted,
    Scarce,
    check_same,
    config_of,
    run,
    tiny_model,
    tokens,
)
from tests.lanes.reference import solo_decode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_model(tmp_path_factory)


def test_a_cancelled_stream_keeps_what_it_fed_and_an_errored_one_nothing(tiny) -> None:
    """Cancelled while prefilling, a stream keeps the prompt rows it fed, which the same prompt then reuses; a stream
    that fails alone (its pass raises) keeps nothing, while the stream beside it keeps its cache."""
    poison = 5

    class Poisoned(Counted):
        def forward(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
            if any(poison in r.token_ids for r in rows):
                raise RuntimeError("poisoned pass (test)")
            return super().forward(rows, *args, **kwargs)

    config = config_of("copy")
    engine = Engine(Poisoned(tiny), EngineConfig(**config))
    prompt = [t for t in tokens(60, tiny.vocab_size, 9) if t != poison]
    stream = engine.submit(prompt, 8)
    engine.step()  # one prompt chunk of 24
    stream.cancel()
    engine.run_until_idle()
    assert stream.finish_reason == "cancelled" and engine.prefixes.n_kept == 1
    again = run(engine, prompt, 8, GREEDY)
    assert again.n_cached == 24
    check_same(tiny, again, 8, GREEDY, **config)
    assert engine.prefixes.n_kept == 1  # `again`'s cache, kept in its turn
    engine.prefixes.clear()
    bad = engine.submit([*prompt[:30], poison, *prompt[30:]], 8)
    good = engine.submit(tokens(40, tiny.vocab_size, 10), 8)
    engine.run_until_idle()
    assert bad.finish_reason == "error" and good.finish_reason in ("stop", "length")
    assert engine.prefixes.n_kept == 1 and engine.prefixes._kept[0].tokens[:40] == good.prompt_ids


def test_the_store_keeps_within_its_count_and_bytes(tiny) -> None:
    """At most max_streams caches are kept, the newest; their positions' bytes stay within prefix_cache_mb."""
    engine = Engine(tiny, EngineConfig(**config_of("none"), max_streams=2))
    prompts = [tokens(20, tiny.vocab_size, 20 + i) for i in range(5)]
    for prompt in prompts:
        run(engine, prompt, 4, GREEDY)
        assert engine.prefixes.n_kept <= 2
    assert engine.prefixes.n_kept == 2
    assert run(engine, prompts[0] + [1, 2], 4, GREEDY).n_cached == 0  # the oldest went first
    assert run(engine, prompts[4] + [1, 2], 4, GREEDY).n_cached == 20

    per_position = tiny.cache_for(1, 1).nbytes // 256
    engine = Engine(tiny, EngineConfig(**config_of("none"), prefix_cache_mb=1))
    n_fit = (1 << 20) // (per_position * 300)
    for i in range(n_fit + 3):
        run(engine, tokens(296, tiny.vocab_size, 40 + i), 4, GREEDY)
        assert engine.prefixes.nbytes <= 1 << 20
    assert engine.prefixes.n_kept == n_fit >= 2


def test_a_store_of_0_bytes_keeps_nothing() -> None:
    """Off is off, for caches that do not say their bytes too (the fake target's); on, the fake target's are kept."""
    for mb, n_kept in ((0, 0), (1, 1)):
        engine = Engine(FakeTarget(48), EngineConfig(timed=False, prefix_cache_mb=mb))
        first = engine.submit(list(range(1, 30)), 8)
        engine.run_until_idle()
        assert engine.prefixes.n_kept == n_kept
        prompt = [*range(1, 26), 7, 7, 7, 7]  # (capacity 37 as the first's: the fake's capacities are exact)
        second = engine.submit(prompt, 8)
        engine.run_until_idle()
        assert len(first.token_ids) == 8 and second.n_cached == (0 if mb == 0 else 25)
        assert second.token_ids == solo_decode(FakeTarget(48), prompt, 8, GREEDY)


def test_kept_caches_make_room_for_live_streams() -> None:
    """Live streams' positions are counted first: keeping or admitting drops the oldest kept caches beyond the bytes
    left; only matches of at least MIN_REUSE tokens covering half a kept cache's tokens are taken."""

    class Cache:
        capacity, nbytes = 10, 100  # 10 bytes a position

    store = PrefixStore(max_bytes=1000, max_kept=8)
    for i in range(3):
        store.keep(Cache(), [i] * 20)  # 200 bytes each
    store.fit(live_bytes=500)
    assert store.n_kept == 2 and store.nbytes == 400
    store.keep(Cache(), [9] * 20, live_bytes=700)
    assert store.n_kept == 1 and store.nbytes == 200
    store.keep(Cache(), [7] * (MIN_REUSE - 1))
    assert store.n_kept == 1  # too short to be worth keeping
    store.keep(Cache(), list(range(40)))
    assert store.adopt([*range(19), 99], 10, 10) is None  # 19 of 40: under half
    found = store.adopt([*range(25), 99], 10, 10)
    assert found is not None and found[1] == 25 and store.n_kept == 1


def test_a_cache_that_cannot_be_allocated_beside_kept_ones_drops_them(tiny) -> None:
    """A live stream never fails for kept prefixes: when its cache cannot be allocated (a pool out of memory), every
    kept cache is dropped, the one it would copy from too, and the allocation tried again."""

    config = config_of("none")
    engine = Engine(Scarce(tiny, 2), EngineConfig(**config))
    for i in range(2):
        run(engine, tokens(30, tiny.vocab_size, 60 + i), 4, GREEDY)
    assert engine.prefixes.n_kept == 2
    stream = run(engine, tokens(30, tiny.vocab_size, 62), 8, GREEDY)
    assert stream.finish_reason in ("stop", "length") and engine.prefixes.n_kept == 1
    check_same(tiny, stream, 8, GREEDY, **config)
    # room for one cache: a stream that would copy a kept cache too small for its reply drops it and starts afresh
    engine = Engine(Scarce(tiny, 1), EngineConfig(**config))
    first = run(engine, tokens(300, tiny.vocab_size, 63), 100, GREEDY)  # capacity 512
    grown = first.prompt_ids + first.token_ids + tokens(200, tiny.vocab_size, 64)
    second = run(engine, grown, 100, GREEDY)  # capacity 768: would copy
    assert second.finish_reason in ("stop", "length") and second.n_cached == 0 and engine.stats().prefix_hits == 0
    check_same(tiny, second, 100, GREEDY, **config)
