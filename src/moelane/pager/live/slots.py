"""The store's slot table: which expert holds which pool slot, and the order in which slots are given up.

Plain numpy bookkeeping with no locking, no I/O and no threads (the store's lock guards every call), so the eviction
rules can be read and tested on their own. Keys are flat expert ids, `layer index * E + expert`.

Per slot: the key it holds (-1: none), its state (EMPTY, LOADING, READY), how many passes lease it, the token
generation and tick of its last use, the pin credit and hard flag of its key, the tier it was loaded at, and which
prefetch source loaded it (0: a demand miss, or already used). Per key: its slot (-1: not resident), use count (LFU)
and what the applied plan says about it (pin credit, hard pin, tier).

Eviction order among slots that may go (not leased, not loading, not hard-pinned, not kept by the caller):
empty slots first, then by policy -- "planner": oldest generation (plus pin credit) first, then least recent tick;
"lru": least recent tick; "lfu": fewest uses, then least recent tick. Prefetches may only take empty slots or slots
not used in the current generation.

Invariant (`check`): `slot_of[key[s]] == s` for every held slot, and no key is held twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

EMPTY, LOADING, READY = 0, 1, 2
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Residency:
    """A copy of the table's per-key view, for people watching the pool (a dashboard's sample, not the hot path)."""

    tier: npt.NDArray[np.int8]  # the tier a held key was loaded at (loading or ready); -1: not held
    pinned: npt.NDArray[np.bool_]  # the applied plan pins it (eviction credit or hard)
    hard: npt.NDArray[np.bool_]  # ... hard: never evicted
    count: IntArray  # passes that used it (LFU's count)


class SlotTable:
    def __init__(self, n_slots: int, n_keys: int, policy: str, default_tier: int) -> None:
        s, n = n_slots, n_keys
        self.policy = policy
        self.key = np.full(s, -1, np.int64)
        self.state, self.lease = np.zeros(s, np.int8), np.zeros(s, np.int32)
        self.gen, self.tick = np.zeros(s, np.int64), np.zeros(s, np.int64)
        self.credit, self.hard = np.zeros(s, np.int64), np.zeros(s, bool)
        self.tier, self.source = np.zeros(s, np.int8), np.zeros(s, np.int8)
        self.slot_of = np.full(n, -1, np.int64)
        self.count, self.credit_of = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.hard_of, self.tier_of = np.zeros(n, bool), np.full(n, default_tier, np.int8)
        self.now_gen, self.now_tick = 0, 0
        self.n_held, self.high_water = 0, 0

    @property
    def n_slots(self) -> int:
        return int(self.key.size)

    def victims(self, n: int, keep: IntArray, prefetch: bool = False) -> list[int] | None:
        """`n` slots to reuse, cheapest first by the policy, never one in `keep`. A demand (not `prefetch`) gets
        None when fewer than `n` exist; a prefetch gets as many as exist."""
        ok = (self.lease == 0) & (self.state != LOADING) & ~self.hard
        if prefetch:
            ok &= (self.gen < self.now_gen) | (self.state == EMPTY)
        ok[keep] = False
        cand = np.flatnonzero(ok)
        if len(cand) < n and not prefetch:
            return None
        n = min(n, len(cand))
        if n == 0:
            return []
        key = self.eviction_key(cand)
        pick = cand if n == len(cand) else cand[np.argpartition(key, n - 1)[:n]]
        return [int(s) for s in pick]

    def eviction_key(self, cand: IntArray) -> IntArray:
        tick = self.tick[cand]
        if self.policy == "lru":
            key = tick
        elif self.policy == "lfu":
            key = (self.count[np.maximum(self.key[cand], 0)] << 32) + tick
        else:
            key = ((self.gen[cand] + self.credit[cand]) << 32) + tick
        return np.asarray(np.where(self.state[cand] == EMPTY, -1, key), np.int64)

    def assign(self, slot: int, key: int, source: int) -> tuple[int, int]:
        """Give `slot` to `key` (LOADING); -> (the key evicted or -1, the prefetch source that had loaded it)."""
        old, old_source = int(self.key[slot]), int(self.source[slot])
        if old >= 0:
            self.slot_of[old] = -1
            self.n_held -= 1
        assert self.slot_of[key] < 0 and self.lease[slot] == 0 and self.state[slot] != LOADING
        self.key[slot], self.slot_of[key] = key, slot
        self.state[slot], self.source[slot], self.tier[slot] = LOADING, source, self.tier_of[key]
        self.credit[slot], self.hard[slot] = self.credit_of[key], self.hard_of[key]
        self.gen[slot], self.tick[slot] = self.now_gen, self.now_tick
        self.n_held += 1
        self.high_water = max(self.high_water, self.n_held)
        return old, old_source

    def free(self, slot: int) -> None:
        """A load failed: the slot holds nothing (its leases, if any, are released by their holders)."""
        key = int(self.key[slot])
        if key >= 0:
            self.slot_of[key] = -1
            self.n_held -= 1
        self.key[slot], self.state[slot], self.source[slot] = -1, EMPTY, 0

    def touch(self, keys: IntArray) -> IntArray:
        """Lease the (resident) keys' slots for one pass and mark them used now. -> their slots."""
        slots = self.slot_of[keys]
        self.lease[slots] += 1
        self.gen[slots], self.tick[slots] = self.now_gen, self.now_tick
        self.count[keys] += 1
        return slots

    def set_plan(self, credit_of: IntArray, hard_of: npt.NDArray[np.bool_], tier_of: npt.NDArray[np.int8]) -> None:
        self.credit_of[:], self.hard_of[:], self.tier_of[:] = credit_of, hard_of, tier_of
        held = self.key >= 0
        self.credit[held] = self.credit_of[self.key[held]]
        self.hard[held] = self.hard_of[self.key[held]]

    def residency(self) -> Residency:
        """Copies of the per-key arrays (the caller holds the store's lock)."""
        tier = np.full(self.slot_of.size, -1, np.int8)
        held = self.slot_of >= 0
        tier[held] = self.tier[self.slot_of[held]]
        return Residency(tier, (self.credit_of > 0) | self.hard_of, self.hard_of.copy(), self.count.copy())

    def check(self) -> None:
        held = np.flatnonzero(self.key >= 0)
        assert (self.slot_of[self.key[held]] == held).all()
        assert int((self.slot_of >= 0).sum()) == len(held) == self.n_held
        assert (self.lease >= 0).all()
