"""Prefix caching: the KV caches of finished streams, kept so that a request starting with the same tokens (a chat
client resending its conversation, an agent its transcript) feeds only what follows them.

When a stream ends (stop, length, cancelled; not after an error) the engine keeps its cache with the tokens whose K/V
it validly holds (`valid_tokens`). When a stream joins, `PrefixStore.take` gives it the kept cache sharing the longest
prefix with its prompt, whole (no copy: the kept cache leaves the store), and the stream starts feeding where the
match ends, or at its last prompt token, whose row gives the first logits. Stale rows past that point are masked by
attention and overwritten as the stream feeds. A kept cache too small for the stream's reply (a conversation grows
past its capacity every few turns) has its matching rows copied into a cache of the stream's own, where the cache
can copy (`copy_from`: `LM`'s can).

Replies stay token-identical to decoding the prompt alone, since every reused row holds the bits the stream's own
prefill would have written there:
- a row's bits do not depend on what shares its pass (docs/batch-invariance.md), so rows written beside other
  streams, in other prompt chunks or as verified drafts are those of a prefill. Eager rows, that is: a compiled
  target's generated rows are not bit-identical to eager prompt rows, so from a target with its decode step compiled
  only the prompt's rows are kept;
- attention reads a cache in blocks of REACH keys, or whole below that, and MKL's product takes another path below
  384 keys. A kept cache is therefore used only where its capacity is the one `capacity_for` gives the request, or
  both are at least REACH (`interchangeable`; a copy gives the rows the same bits);
- requests asking for the prompt's log-probabilities need every prompt row's logits: they never adopt.

Bounds: at most `max_kept` caches (the engine's `max_streams`: pools then hold at most twice the slots live streams
take), and the K/V positions they hold (tokens kept times bytes per position) within `max_bytes` once the live
streams' positions are counted first; the oldest kept goes first (a cache leaves the store when it is adopted, so the
oldest is also the least recently used). A live stream's cache that cannot be allocated is tried again once every
kept cache is dropped. The store belongs to the engine thread. The draft model's caches are kept in a store of their
own (`ModelDrafter.kept`), with no rule held back: a draft cache's bits only decide what is verified.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moelane.lanes.lane import Lane
from moelane.model.attention import REACH

log = logging.getLogger(__name__)
MIN_REUSE = 16  # fewer matching tokens are not worth taking a kept cache over (it may serve its own conversation)
SIMILARITY = 0.5  # a match must cover this share of a kept cache's tokens (llama.cpp's slot similarity, 0.5 too):
# a new conversation that shares only a system prompt with a long kept one leaves it to that one's next turn


@dataclass(slots=True, eq=False)
class Kept:
    cache: Any
    tokens: list[int]  # the tokens whose K/V the cache holds at positions 0..len-1

    @property
    def nbytes(self) -> int:
        return len(self.tokens) * position_bytes(self.cache)


class PrefixStore:
    def __init__(self, max_bytes: int, max_kept: int) -> None:
        self.max_bytes, self.max_kept = max_bytes, max_kept
        self._kept: list[Kept] = []  # oldest first
        self.n_hits = 0  # streams that adopted a kept cache
        self.n_reused = 0  # prompt tokens they did not feed

    @property
    def n_kept(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self._kept)

    def keep(self, cache: Any, tokens: list[int], live_bytes: int = 0) -> None:
        """Keep `cache`, which holds the K/V of `tokens` from position 0, unless it is too short to reuse or too big
        to keep (a store of 0 bytes keeps nothing, caches that do not say their bytes included); then drop the oldest
        kept caches beyond the bounds."""
        too_big = len(tokens) * position_bytes(cache) > self.max_bytes
        if len(tokens) < MIN_REUSE or too_big or self.max_bytes < 1 or self.max_kept < 1:
            return
        self._kept.append(Kept(cache, tokens))
        self.fit(live_bytes)

    def fit(self, live_bytes: int = 0) -> None:
        """Drop the oldest kept caches until they are within the bounds, with `live_bytes` held by live streams."""
        while self._kept and (len(self._kept) > self.max_kept or self.nbytes + live_bytes > self.max_bytes):
            self._kept.pop(0)

    def clear(self) -> int:
        """Drop every kept cache; -> how many there were."""
        n, self._kept = len(self._kept), []
        return n

    def take(
        self, target: Any, prompt: list[int], max_tokens: int, live_bytes: int = 0, reuse: bool = True
    ) -> tuple[Any, int]:
        """A cache for a stream of `prompt` and `max_tokens` from `target`, and the position it starts feeding at: a
        kept cache sharing a prefix with the prompt (whole, or copied into a new one if it is too small for the
        reply, where it can copy: `copy_from`), else a new one, for which kept caches make room within the bounds
        with `live_bytes` counted first, and are all dropped if it cannot be allocated beside them (the one it would
        copy from too)."""
        n_prompt, need = len(prompt), len(prompt) + max_tokens
        capacity_for = getattr(target, "capacity_for", None)
        kept, start = None, 0
        if self._kept and reuse and callable(capacity_for):
            kept, start = self.adopt(prompt, capacity_for(n_prompt, max_tokens), need) or (None, 0)
            if kept is not None and kept.capacity >= need:
                return self._counted(kept, start)
        try:
            cache = target.cache_for(n_prompt, max_tokens)
        except Exception:
            if not self.clear() and kept is None:
                raise
            log.warning("a stream's KV cache could not be allocated beside kept prefixes: dropped them, trying again")
            kept, start = None, 0
            cache = target.cache_for(n_prompt, max_tokens)
        self.fit(live_bytes + n_prompt * position_bytes(cache))
        if kept is None:
            return cache, 0
        cache.copy_from(kept, start)
        return self._counted(cache, start)

    def _counted(self, cache: Any, start: int) -> tuple[Any, int]:
        self.n_hits += 1
        self.n_reused += start
        return cache, start

    def adopt(self, prompt: list[int], capacity: int, need: int) -> tuple[Any, int] | None:
        """The kept cache sharing the longest prefix with `prompt` (the newest on ties) among those that give a stream
        of this `capacity` (needing `need` positions) its own bits, taken out of the store, and the position to feed
        from; None if no match is worth it."""
        best, n_best = None, 0
        for kept in self._kept:
            fits = kept.cache.capacity >= need or callable(getattr(kept.cache, "copy_from", None))
            if not (fits and interchangeable(kept.cache.capacity, capacity)):
                continue
            n = common_prefix(kept.tokens, prompt)
            if n >= max(MIN_REUSE, SIMILARITY * len(kept.tokens), n_best):
                best, n_best = kept, n
        if best is None:
            return None
        self._kept.remove(best)
        return best.cache, min(n_best, len(prompt) - 1)  # the last prompt token is fed: its row gives the first logits


def interchangeable(kept: int, capacity: int) -> bool:
    """Whether a cache of `kept` positions gives a stream the bits of a cache of `capacity`: attention reads a cache
    whole below REACH, in blocks of REACH from there on, and below 384 keys MKL takes another path; so the capacities
    must be equal, or both at least REACH."""
    return kept == capacity or (kept >= REACH and capacity >= REACH)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def position_bytes(cache: Any) -> int:
    """Bytes of K/V one position of `cache` holds (0 for a cache that does not say: the fake target's)."""
    return int(getattr(cache, "nbytes", 0)) // max(1, int(cache.capacity))


def live_bytes(lanes: Sequence[Lane]) -> int:
    """Bytes of K/V the positions the live streams hold take."""
    return sum(len(x.tokens) * position_bytes(x.cache) for x in lanes if x.cache is not None)


def valid_tokens(lane: Lane, target: Any) -> list[int]:
    """The tokens whose K/V a finished stream's cache holds as a prefill of them would write them: `tokens[:n_fed]`
    (a stop or length cut may leave `n_fed` past the tokens kept), only the prompt's when the target's decode step is
    compiled (its generated rows have other bits than eager prompt rows)."""
    n = min(lane.n_fed, len(lane.tokens))
    if getattr(target, "compile_enabled", False):
        n = min(n, lane.n_prompt)
    return lane.tokens[:n]


def admit_cache(target: Any, store: PrefixStore, lane: Lane, live: Sequence[Lane]) -> Any:
    """A cache for the joining `lane` from `store.take` (`lane.n_fed` then starts past a reused prefix), with the
    `live` streams' positions counted first."""
    prompt = lane.tokens[: lane.n_prompt]
    cache, lane.n_fed = store.take(target, prompt, lane.stream.max_tokens, live_bytes(live), not lane.prompt_logprobs)
    lane.stream.n_cached = lane.n_fed
    return cache
