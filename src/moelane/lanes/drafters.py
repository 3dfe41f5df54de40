"""Drafters: proposals for the tokens that follow a stream, verified by the target in the next round.

- `CopyDrafter` (context copy, prompt lookup): a 3-gram index over the stream's own prompt and reply; the longest
  backward match of the stream's tail (up to 64 tokens, newest occurrence first on ties, at least `min_match`)
  proposes what followed it; a match that overlaps the tail (a repeating reply) proposes the repeat on and on, not
  just up to the end. After 4 held proposals with nothing accepted it goes silent for 16 rounds.
- `RecallDrafter`: the same over a `RecallStore` of earlier requests' replies (with the end of their prompts), shared
  across requests and bounded in tokens; it also copies from the stream's own context and keeps the longer match.
- `ModelDrafter`: a small model with the target's tokenizer, greedy, with its own per-stream caches; each draft
  level costs one batched pass of the draft model (its compiled decode step, if it has one), so it drafts exactly
  the depths it is asked for, as far as its own context holds the stream (none for a prompt past it). `prepare`
  catches its caches up with tokens committed while a stream did not draft.
  Finished streams' draft caches are kept for prompts with the same start (`kept`, `moelane.lanes.prefix`).
  `load_draft_model` loads one (by default the shipped one, its decode step compiled).

A drafter never changes a reply: it only decides what is verified. `propose` is called only in drafted rounds.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from moelane.errors import InputError
from moelane.lanes.lane import Lane
from moelane.lanes.ngram import NgramIndex, longest_match
from moelane.lanes.prefix import PrefixStore, position_bytes
from moelane.model.cache import Rows
from moelane.model.sampling import argmax

log = logging.getLogger(__name__)
MAX_MATCH = 64
MIN_MATCH = 6
SILENT_AFTER_MISSES = 4
SILENT_ROUNDS = 16
RECALL_PROMPT_TAIL = 64  # prompt tokens kept in the recall store before each reply
# A draft model's feeds of at most this many tokens past the prompt run as generated rows (`Rows.decode`: through its
# compiled decode step, if it has one); longer catch-ups run eagerly. Measured on the shipped draft model (one
# thread): a compiled call ~0.5 ms for one row and ~0.3 ms each further row, an eager pass 3-4 ms for a few rows.
DECODE_FEED = 8


class Drafter(Protocol):
    @property
    def costs_passes(self) -> bool:
        """True if each draft level costs a forward pass (then `propose` drafts exactly the depths asked)."""
        ...

    def propose(self, lanes: Sequence[Lane], depths: Sequence[int]) -> list[list[int]]:
        """Up to `depths[i]` draft tokens following `lanes[i].tokens`."""
        ...

    def feedback(self, lane: Lane, n_offered: int, n_accepted: int) -> None: ...

    def prepare(self, lanes: Sequence[Lane]) -> None:
        """New lanes joined: do the work that needs only their prompts (indexing, draft-model prefill)."""
        ...

    def release(self, lane: Lane) -> None:
        """The lane has finished (or was cancelled): drop its state, learn from its reply."""
        ...


class _CopyState:
    __slots__ = ("index", "misses", "silent")

    def __init__(self) -> None:
        self.index = NgramIndex()
        self.misses = 0
        self.silent = 0


class CopyDrafter:
    costs_passes = False

    def __init__(self, min_match: int = MIN_MATCH) -> None:
        self.min_match = min_match
        self._states: dict[int, _CopyState] = {}

    def _state(self, lane: Lane) -> _CopyState:
        state = self._states.get(lane.id)
        if state is None:
            state = self._states[lane.id] = _CopyState()
        return state

    def propose(self, lanes: Sequence[Lane], depths: Sequence[int]) -> list[list[int]]:
        return [self._propose_one(lane, depth) for lane, depth in zip(lanes, depths, strict=True)]

    def _propose_one(self, lane: Lane, depth: int) -> list[int]:
        state = self._state(lane)
        state.index.extend(lane.tokens)
        if state.silent > 0:
            state.silent -= 1
            return []
        if depth <= 0:
            return []
        found = longest_match(state.index, lane.tokens, lane.tokens, MAX_MATCH, exclude_end=len(lane.tokens))
        if found is None or found[1] < self.min_match:
            return []
        return periodic(lane.tokens, found[0], depth)

    def prepare(self, lanes: Sequence[Lane]) -> None:
        for lane in lanes:
            self._state(lane).index.extend(lane.tokens)

    def feedback(self, lane: Lane, n_offered: int, n_accepted: int) -> None:
        if n_offered == 0:
            return
        state = self._state(lane)
        if n_accepted:
            state.misses = 0
            return
        state.misses += 1
        if state.misses >= SILENT_AFTER_MISSES:
            state.misses, state.silent = 0, SILENT_ROUNDS

    def release(self, lane: Lane) -> None:
        self._states.pop(lane.id, None)


class RecallStore:
    """Earlier replies (each after the tail of its prompt), indexed by 3-grams, at most `max_tokens` tokens in all;
    the oldest go first. Thread-safe: engines may share one."""

    def __init__(self, max_tokens: int = 1 << 20) -> None:
        if max_tokens < 1:
            raise ValueError(f"a recall store needs max_tokens >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._seqs: dict[int, list[int]] = {}  # insertion order = age
        self._indexes: dict[int, NgramIndex] = {}
        self._n_tokens = 0
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    def add(self, token_ids: list[int]) -> None:
        if len(token_ids) < 4 or len(token_ids) > self.max_tokens:
            return
        with self._lock:
            seq_id, self._next_id = self._next_id, self._next_id + 1
            index = NgramIndex()
            index.extend(token_ids)
            self._seqs[seq_id], self._indexes[seq_id] = list(token_ids), index
            self._n_tokens += len(token_ids)
            while self._n_tokens > self.max_tokens:
                oldest = next(iter(self._seqs))
                self._n_tokens -= len(self._seqs.pop(oldest))
                del self._indexes[oldest]

    def match(self, query: list[int], max_match: int) -> tuple[list[int], int, int] | None:
        """The stored sequence, continuation start and length of the longest backward match of `query`'s tail,
        newest sequence first on ties."""
        best: tuple[list[int], int, int] | None = None
        with self._lock:
            for seq_id in reversed(self._seqs):
                seq = self._seqs[seq_id]
                found = longest_match(self._indexes[seq_id], seq, query, max_match, exclude_end=len(seq))
                if found is not None and (best is None or found[1] > best[2]):
                    best = (seq, found[0], found[1])
        return best


def periodic(tokens: list[int], start: int, depth: int) -> list[int]:
    """The `depth` tokens that follow `tokens` if it goes on as it went on from `start`: what followed the match,
    and where that runs into the end (a match overlapping the tail, as in a repeating reply) the same period again."""
    period = len(tokens) - start
    return [tokens[start + j % period] for j in range(depth)]


class RecallDrafter(CopyDrafter):
    def __init__(self, store: RecallStore, min_match: int = MIN_MATCH) -> None:
        super().__init__(min_match)
        self.store = store

    def _propose_one(self, lane: Lane, depth: int) -> list[int]:
        own = super()._propose_one(lane, depth)
        if depth <= 0 or self._state(lane).silent > 0:
            return own
        found = self.store.match(lane.tokens, MAX_MATCH)
        if found is None or found[2] < self.min_match or len(own) >= depth:
            return own
        seq, start, _ = found
        recalled = seq[start : start + depth]
        return recalled if len(recalled) > len(own) else own

    def release(self, lane: Lane) -> None:
        super().release(lane)
        self.store.add(lane.tokens[max(0, lane.n_prompt - RECALL_PROMPT_TAIL) :])


class _DraftCache:
    __slots__ = ("cache", "fed", "n_fed")

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.n_fed = 0  # lane.tokens[:n_fed] are in the draft cache
        self.fed: list[int] = []  # drafts fed after them last time (valid while they match the lane's tokens)


class ModelDrafter:
    costs_passes = True

    def __init__(self, draft: Any, prefill_chunk: int = 64, prefix_bytes: int = 0, max_kept: int = 16) -> None:
        """`prefix_bytes`, `max_kept`: the bounds of the draft caches kept for later prompts with the same start
        (`moelane.lanes.prefix`; a draft cache's bits never change a reply, only what is verified)."""
        self.draft = draft  # target protocol: new_cache / cache_for / forward
        # (at least 2: a level's first feed while drafting goes on is the last accepted draft and the target's token;
        # fed one at a time, the draft model never caught up to draft)
        self.prefill_chunk = max(prefill_chunk, 2)
        self._caches: dict[int, _DraftCache] = {}
        self.kept = PrefixStore(prefix_bytes, max_kept)

    def propose(self, lanes: Sequence[Lane], depths: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in lanes]
        caches = {i: self._sync(lanes[i]) for i, d in enumerate(depths) if d > 0 and self._holds(lanes[i])}
        # the draft cache may be shorter than the stream's (a draft model of a shorter context): depth k feeds
        # positions up to len(tokens) + k - 2
        depths = [min(d, caches[i].cache.capacity - len(lanes[i].tokens) + 1) if i in caches else 0
                  for i, d in enumerate(depths)]  # fmt: skip
        active = [i for i in caches if depths[i] > 0]
        while active:  # one batched draft pass per draft level
            feeds = {i: self._feed(lanes[i], caches[i], out[i]) for i in active}
            rows = [self._rows(lanes[i], caches[i], feeds[i]) for i in active]
            logits = self.draft.forward(rows, last_only=True)
            still = []
            for i, lg in zip(active, logits, strict=True):
                dc = caches[i]
                if out[i]:
                    dc.fed.append(feeds[i][0])
                else:
                    dc.n_fed += len(feeds[i])
                    if dc.n_fed < len(lanes[i].tokens):
                        continue  # the draft model is still prefilling this stream: no drafts this round
                out[i].append(argmax(lg[-1]))
                if len(out[i]) < depths[i]:
                    still.append(i)
            active = still
        return out

    def _feed(self, lane: Lane, dc: _DraftCache, drafted: list[int]) -> list[int]:
        return [drafted[-1]] if drafted else lane.tokens[dc.n_fed : dc.n_fed + self.prefill_chunk]

    @staticmethod
    def _rows(lane: Lane, dc: _DraftCache, feed: list[int]) -> Rows:
        start = dc.n_fed + len(dc.fed)
        return Rows(dc.cache, feed, start, lane.id, decode=start >= lane.n_prompt and len(feed) <= DECODE_FEED)

    def _holds(self, lane: Lane) -> bool:
        """Whether the draft model's context holds the stream's prompt (with room for a token): it drafts for no
        other stream."""
        return lane.n_prompt < getattr(self.draft, "max_context", lane.n_prompt + 1)

    def _sync(self, lane: Lane) -> _DraftCache:
        """Keep the fed drafts that the stream committed; always leave the last token to feed (its logits)."""
        dc = self._caches.get(lane.id)
        if dc is None:
            prompt = lane.tokens[: lane.n_prompt]
            cache, start = self.kept.take(self.draft, prompt, lane.stream.max_tokens, self._live_bytes())
            dc = self._caches[lane.id] = _DraftCache(cache)
            dc.n_fed = start
        for tok in dc.fed:
            if dc.n_fed >= len(lane.tokens) or lane.tokens[dc.n_fed] != tok:
                break
            dc.n_fed += 1
        dc.n_fed = min(dc.n_fed, len(lane.tokens) - 1)
        dc.fed = []
        return dc

    def prepare(self, lanes: Sequence[Lane], leave: int = 1) -> None:
        """Catch the draft caches up with the streams' tokens (a joining stream's prompt, or the tokens committed
        while the stream did not draft), all but the last `leave`, which `propose` feeds."""
        lanes = [x for x in lanes if self._holds(x)]
        caches = {lane.id: self._sync(lane) for lane in lanes}
        ends = {x.id: min(len(x.tokens) - leave, caches[x.id].cache.capacity) for x in lanes}
        while True:
            todo = [x for x in lanes if caches[x.id].n_fed < ends[x.id]]
            if not todo:
                return
            rows = []
            for x in todo:
                dc = caches[x.id]
                end = min(dc.n_fed + self.prefill_chunk, ends[x.id])
                rows.append(self._rows(x, dc, x.tokens[dc.n_fed : end]))
            self.draft.forward(rows, last_only=True)
            for x, r in zip(todo, rows, strict=True):
                caches[x.id].n_fed += len(r.token_ids)

    def feedback(self, lane: Lane, n_offered: int, n_accepted: int) -> None:
        pass

    def release(self, lane: Lane) -> None:
        dc = self._caches.pop(lane.id, None)
        if dc is not None:
            self.kept.keep(dc.cache, lane.tokens[: min(dc.n_fed, len(lane.tokens))], self._live_bytes())

    def _live_bytes(self) -> int:
        return sum(dc.n_fed * position_bytes(dc.cache) for dc in self._caches.values())


def load_draft_model(path: str | None = None, compile: bool = True) -> Any:
    """A draft model folder (None: the shipped draft model, `moelane.assets.draft_model_path()`). With `compile`,
    its decode step is compiled now (10-30 s the first time, cached after), where torch.compile works here: each draft
    level is then one compiled call. Measured on the shipped draft model, one thread: ~0.5 ms a level for one
    stream, against 3-4 ms eager."""
    from moelane.model.load import load

    if path is None:
        try:
            path = importlib.import_module("moelane.assets").draft_model_path()
        except (ImportError, AttributeError) as e:
            raise InputError("drafter 'model' needs the shipped draft model, which this install lacks") from e
    draft = load(path)
    if compile:
        log.info("compiling the draft model's decode step...")
        draft.enable_compile()
        draft.warm_up(1, 1)  # (where it cannot be compiled, drafting still works, eagerly)
    return draft
