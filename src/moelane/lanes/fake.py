"""A fake target model (docs/design.md#the-round) for testing the engine without a real model.

It implements the target protocol (`new_cache`, `forward(rows)`, `vocab_size`, `eos_ids`) like `LM`. The logits of
a position are a pure function of the stream's token history up to and including that position (the whole history,
or its last `window` tokens, which makes replies repetitive enough for copy drafters), so rows never depend on the
batch and rolled-back rows are simply overwritten. A second instance with `error_rate=0.2` and the same seed serves
as a draft model that is wrong about 1 time in 5. With a `FakeClock`, each pass advances the clock by its price.

With a `footprint` (`moelane.model.footprint`) it is an MoE whose passes also cost `per_byte` for every byte they
read: the dense bytes, and in each of its MoE layers the distinct experts its rows route to. A row routes to top_k of
n_experts chosen by a hash of its token (`routes="token"`: drafts route as new text does), or of its stream's first
token (`routes="stream"`: a stream's rows all share its experts).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import cast

import torch

from moelane.lanes.clock import FakeClock
from moelane.model.cache import Rows
from moelane.model.footprint import Footprint

MASK64 = (1 << 64) - 1


def mix(h: int, x: int) -> int:
    """splitmix64 of `h` combined with `x`: a cheap, well-spread 64-bit hash step."""
    z = (h ^ (x * 0x9E3779B97F4A7C15)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def linear_price(base: float, per_row: float) -> Callable[[int, int], float]:
    """A pass price of `base + per_row * rows` seconds."""
    return lambda n_rows, n_streams: base + per_row * n_rows


class FakeCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = [0] * capacity
        self.prefix = [0] * capacity  # prefix[p]: hash of tokens 0..p
        self.length = 0  # positions 0..length-1 hold written tokens


class FakeTarget:
    def __init__(
        self,
        vocab_size: int = 64,
        *,
        seed: int = 0,
        window: int = 0,
        error_rate: float = 0.0,
        eos_ids: frozenset[int] = frozenset(),
        clock: FakeClock | None = None,
        price: Callable[[int, int], float] | None = None,
        sharpness: float = 2.0,
        footprint: Footprint | None = None,
        per_byte: float = 0.0,
        routes: str = "token",
    ) -> None:
        if vocab_size < 2:
            raise ValueError("the fake target needs a vocabulary of at least 2")
        if not 0.0 <= error_rate < 1.0:
            raise ValueError(f"error_rate must be in [0, 1), got {error_rate}")
        if routes not in ("token", "stream"):
            raise ValueError(f"routes must be 'token' or 'stream', got {routes!r}")
        self.vocab_size = vocab_size
        self.max_context = 1 << 20
        self.eos_ids = eos_ids
        self.seed = seed
        self.window = window
        self.error_rate = error_rate
        self.clock = clock
        self.price = price or linear_price(0.010, 0.0005)
        self.sharpness = sharpness
        self._footprint, self.per_byte, self.routes = footprint, per_byte, routes
        self.n_passes = 0
        self.n_rows = 0

    def footprint(self) -> Footprint | None:
        return self._footprint

    def new_cache(self, capacity: int) -> FakeCache:
        return FakeCache(capacity)

    def capacity_for(self, n_prompt: int, max_tokens: int) -> int:
        return n_prompt + max_tokens

    def cache_for(self, n_prompt: int, max_tokens: int) -> FakeCache:
        return FakeCache(self.capacity_for(n_prompt, max_tokens))

    def forward(self, rows: Sequence[Rows], last_only: bool = False) -> list[torch.Tensor]:
        out = []
        for r in rows:
            cache = cast(FakeCache, r.cache)
            assert r.start <= cache.length, f"rows start at {r.start} past the written length {cache.length}"
            for i, tok in enumerate(r.token_ids):
                p = r.start + i
                cache.tokens[p] = tok
                cache.prefix[p] = mix(cache.prefix[p - 1] if p else mix(self.seed, 0x5EED), tok + 1)
            cache.length = r.end
            first = len(r.token_ids) - 1 if last_only else 0
            out.append(torch.stack([self._logits(cache, r.start + i) for i in range(first, len(r.token_ids))]))
        n_rows = sum(len(r.token_ids) for r in rows)
        self.n_passes += 1
        self.n_rows += n_rows
        if self.clock is not None:
            self.clock.advance(self.price(n_rows, len(rows)) + self.per_byte * self.pass_bytes(rows))
        return out

    def pass_bytes(self, rows: Sequence[Rows]) -> float:
        """Bytes a pass over `rows` reads (0 without a footprint): its distinct experts, in every MoE layer."""
        shape = self._footprint
        if shape is None:
            return 0.0
        experts: set[int] = set()
        for r in rows:
            stream_key = cast(FakeCache, r.cache).tokens[0] if self.routes == "stream" else None
            for token in r.token_ids:
                key = mix(self.seed, (token if stream_key is None else stream_key) + 1)
                experts.update(random.Random(key).sample(range(shape.n_experts), shape.top_k))
        return shape.pass_bytes(shape.n_layers * len(experts))

    def _key(self, cache: FakeCache, pos: int) -> int:
        if self.window <= 0:
            return cache.prefix[pos]
        h = mix(self.seed, 0x5EED)
        for t in cache.tokens[max(0, pos - self.window + 1) : pos + 1]:
            h = mix(h, t + 1)
        return h

    def _logits(self, cache: FakeCache, pos: int) -> torch.Tensor:
        h = self._key(cache, pos)
        g = torch.Generator().manual_seed(h & 0x7FFF_FFFF_FFFF_FFFF)
        logits = torch.randn(self.vocab_size, generator=g) * self.sharpness
        if self.error_rate and (mix(h, 0xD1FF) % 10_000) < self.error_rate * 10_000:
            logits[int(logits.argmax())] = logits.min() - 1.0  # this model is wrong here: its runner-up wins
        return logits
