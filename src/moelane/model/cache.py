"""KV caches: each stream owns one slot of a `KVPool`, a static buffer per attention layer written at absolute
positions.

A pool holds the caches of every stream of one capacity: `k[layer]` is [S, Hkv, C, D] (S slots, C positions). A
stream's capacity is fixed when it starts, so every attention call of a stream reduces over the same length (batch
invariance), and the compiled decode step gathers any set of streams' caches from their pool by slot number (one
graph, no per-stream inputs). A stream's length lives with its owner, not here: rolling back rejected drafts is just
feeding the next rows at an earlier position; stale entries past a row's position are masked by attention.

A slot is zeroed as far as attention will read it (`prepare`, before each pass: a masked key still meets its value
in the attention product, so nothing read may hold NaN bits), block by block as the stream's reach grows, so a cache
that reserves the whole context commits memory only for what the stream has used. Slots are given back when their
`KVCache` is collected. Pools grow by replacing their tensors; slots that were
never taken are never touched, so their pages cost no memory. A pool whose last slot is given back goes back to its
first size, so the memory a burst of streams touched is returned once the burst is over (a pool in use keeps its
size: its taken slots cannot move while a pass may read them). Slot counts go 3, 7, 15, ..., skipping the capacity:
the compiled step takes both as symbols, and two symbols whose sizes agree when it is traced are tied into one.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

FIRST_SLOTS = 3


class KVPool:
    def __init__(
        self,
        shapes: dict[int, tuple[int, int, int]],
        capacity: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        """shapes: per attention layer, (kv heads, key dim, value dim)."""
        self.shapes, self.capacity, self.dtype, self.device = shapes, capacity, dtype, device
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._free: list[int] = []
        self._taken: set[int] = set()
        self._clean: dict[int, int] = {}  # taken slot -> positions zeroed (or written) from 0
        self._lock = threading.Lock()
        self._marked = False
        self._grow(FIRST_SLOTS)

    @property
    def n_slots(self) -> int:
        return next(iter(self.k.values())).shape[0]

    @property
    def n_taken(self) -> int:
        return len(self._taken)

    @property
    def slot_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def take(self) -> int:
        """A free slot (the pool grows when none is free); `prepare` zeroes it as far as it is read."""
        with self._lock:
            if not self._free:
                size = 2 * self.n_slots + 1
                self._grow(size if size != self.capacity else 2 * size + 1)
            slot = self._free.pop()
            self._taken.add(slot)
            self._clean[slot] = 0
            return slot

    def prepare(self, slot: int, upto: int) -> None:
        """Zero `slot`'s positions up to `upto` that are not yet: a pass will read them (masked, but read)."""
        with self._lock:
            clean = self._clean[slot]
            if clean < upto:
                for t in (*self.k.values(), *self.v.values()):
                    t[slot, :, clean:upto].zero_()
                self._clean[slot] = upto

    def give(self, slot: int) -> None:
        with self._lock:
            self._taken.discard(slot)
            self._clean.pop(slot, None)
            self._free.append(slot)
            if not self._taken and self.n_slots > FIRST_SLOTS:
                self.k, self.v, self._free = {}, {}, []  # no cache of this pool is alive, so no pass reads it
                self._grow(FIRST_SLOTS)

    def load(self, slot: int, source: KVPool, source_slot: int, n: int) -> None:
        """Copy positions 0..n-1 of `source`'s `source_slot` (a pool of the same layers) into `slot`, which then
        counts them as clean."""
        with self._lock:
            for store, other in ((self.k, source.k), (self.v, source.v)):
                for layer, t in store.items():
                    t[slot, :, :n].copy_(other[layer][source_slot, :, :n])
            self._clean[slot] = max(self._clean[slot], n)

    def _grow(self, n_slots: int) -> None:
        old = self.n_slots if self.k else 0
        for store, dim in ((self.k, 1), (self.v, 2)):
            for layer, shape in self.shapes.items():
                # empty, not zeros: pages of slots never taken stay untouched
                t = torch.empty(n_slots, shape[0], self.capacity, shape[dim], dtype=self.dtype, device=self.device)
                for slot in self._taken:  # as far as it is clean: beyond, nothing was written or will be read yet
                    clean = self._clean[slot]
                    t[slot, :, :clean].copy_(store[layer][slot, :, :clean])
                store[layer] = t
        self._free = list(range(n_slots - 1, old - 1, -1)) + self._free  # lowest slot first
        self._marked = False

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store row i's k/v [N, Hkv, D] at (slots[i], positions[i]): many streams' rows in one copy each."""
        kp, vp = self.k[layer], self.v[layer]
        kp[slots, :, positions] = k.to(kp.dtype)
        vp[slots, :, positions] = v.to(vp.dtype)

    def mark_dynamic(self) -> None:
        """Let a compiled step take the slot count and capacity as symbols: one graph serves every pool. (Only then:
        importing the compiler costs ~70 MB, which an eager run need not pay.)"""
        if not self._marked:
            for t in (*self.k.values(), *self.v.values()):
                torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 2)
            self._marked = True


class KVCache:
    """One stream's cache: a slot of a pool (`pool.k[layer][slot]`, `pool.v[layer][slot]`, each [Hkv, C, D])."""

    def __init__(self, pool: KVPool) -> None:
        self.pool, self.slot, self.capacity = pool, pool.take(), pool.capacity
        weakref.finalize(self, pool.give, self.slot)

    @property
    def nbytes(self) -> int:
        return self.pool.slot_bytes

    def copy_from(self, other: KVCache, n: int) -> None:
        """Positions 0..n-1 of `other`, a cache of the same model, into this one (prefix caching: a kept cache too
        small for a new stream's reply)."""
        self.pool.load(self.slot, other.pool, other.slot, n)

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [n, Hkv, D] at `positions` [n]; return the layer's whole buffers [Hkv, C, D]."""
        self.pool.write(layer, torch.full_like(positions, self.slot), positions, k, v)
        return self.pool.k[layer][self.slot], self.pool.v[layer][self.slot]


@dataclass(frozen=True, slots=True)
class Rows:
    """One stream's part of a forward pass: `token_ids` fed at positions start, start+1, ..."""

    cache: KVCache
    token_ids: list[int]
    start: int
    stream_id: int = 0
    # Generated tokens (the last committed one, then any drafts; the prompt all fed): a compiled model runs them
    # through its compiled decode step, as `LM.step` does, so each row has the same bits in a shared round as in a
    # decode alone.
    decode: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("Rows needs at least one token")
        if self.start < 0 or self.end > self.cache.capacity:
            raise ValueError(
                f"rows at positions {self.start}..{self.end - 1} do not fit a cache of {self.cache.capacity}"
            )

    @property
    def end(self) -> int:
        """The position after the last row."""
        return self.start + len(self.token_ids)
