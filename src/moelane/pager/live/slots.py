"""The store's slot table: which expert holds which pool slot, the bytes they hold, and the order slots are given up.

Plain numpy bookkeeping with no locking, no I/O and no threads (the store's lock guards every call), so the eviction
rules can be read and tested on their own. Keys are flat expert ids, `layer index * E + expert`.

Slots: one range per precision tier, `first[t] ..< first[t] + capacity[t]` (the store's pool of that tier), so a
slot's tier, and its bytes (`tier_bytes[t]`), are fixed by its number. Per slot: the key it holds (-1: none), its
state (EMPTY, LOADING, READY), how many passes lease it, the token generation and tick of its last use, the pin credit
and hard flag of its key, which prefetch source loaded it (0: a demand miss, or already used), and `retire`: a copy
whose key has been re-admitted at another tier, kept only while a lease holds it or its load runs. Per key: its slot
(-1: not resident), use count (LFU) and what the applied plan says about it (pin credit, hard pin, tier).

Bytes: `held_bytes` is the sum of the bytes of every slot not EMPTY (retiring copies and loads in flight included),
and `admit` never lets it pass `budget`: it first evicts, in policy order across every tier, until the new experts'
bytes fit. Capacities are `budget // tier_bytes[t]`, so whenever the bytes fit, the new expert's tier has an empty slot.

Eviction order among slots that may go (READY, not leased, not retiring, not hard-pinned, not kept by the caller):
"planner": oldest generation (plus pin credit) first, then least recent tick; "lru": least recent tick; "lfu": fewest
uses, then least recent tick. Prefetches may only evict slots not used in the current generation. Freed slots go on
their tier's free list, last freed first out, so a victim of the new expert's own tier is reused at once; `admit`
returns the slots freed and not reused, whose pages the store gives back.

Invariants (`check`): `slot_of[key[s]] == s` for every held slot not retiring, so no key has two live copies; a
retiring slot is leased or loading; `held_bytes` is the bytes of the slots held, and at most `budget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

EMPTY, LOADING, READY = 0, 1, 2
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Admission:
    """What `admit` did: `slots[i]` now holds key `keys[i]` (LOADING); `evicted` (old key, its prefetch source) per
    victim; `freed`: victims left empty (their pages can go back)."""

    keys: list[int]
    slots: list[int]
    evicted: list[tuple[int, int]]
    freed: list[int]


@dataclass(frozen=True, slots=True)
class Residency:
    """A copy of the table's per-key view, for people watching the pool (a dashboard's sample, not the hot path)."""

    tier: npt.NDArray[np.int8]  # the tier a held key was loaded at (loading or ready); -1: not held
    pinned: npt.NDArray[np.bool_]  # the applied plan pins it (eviction credit or hard)
    hard: npt.NDArray[np.bool_]  # ... hard: never evicted
    count: IntArray  # passes that used it (LFU's count)


class SlotTable:
    def __init__(
        self, capacity: Sequence[int], tier_bytes: Sequence[int], budget: int, n_keys: int, policy: str,
        default_tier: int,
    ) -> None:  # fmt: skip
        caps = np.asarray(capacity, np.int64)
        self.capacity, self.tier_bytes, self.budget = caps, np.asarray(tier_bytes, np.int64), budget
        self.first = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int64)
        s, n = int(caps.sum()), n_keys
        self.policy = policy
        self.tier = np.repeat(np.arange(len(caps), dtype=np.int8), caps)
        self.nbytes = self.tier_bytes[self.tier]
        self.key = np.full(s, -1, np.int64)
        self.state, self.lease = np.zeros(s, np.int8), np.zeros(s, np.int32)
        self.gen, self.tick = np.zeros(s, np.int64), np.zeros(s, np.int64)
        self.credit, self.hard = np.zeros(s, np.int64), np.zeros(s, bool)
        self.source, self.retire = np.zeros(s, np.int8), np.zeros(s, bool)
        self.slot_of = np.full(n, -1, np.int64)
        self.count, self.credit_of = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.hard_of, self.tier_of = np.zeros(n, bool), np.full(n, default_tier, np.int8)
        self.now_gen, self.now_tick = 0, 0
        self.held_bytes, self.high_water = 0, 0
        self._free = [list(range(int(f + c) - 1, int(f) - 1, -1)) for f, c in zip(self.first, caps, strict=True)]
        self._span = (0, 0)  # the slots of the tiers in use (`use_tier`): the only ones victims are looked for in

    def use_tier(self, tier: int) -> None:
        """Experts may be held at `tier` from now on (its pool exists)."""
        lo, hi = int(self.first[tier]), int(self.first[tier] + self.capacity[tier])
        self._span = (lo, hi) if self._span == (0, 0) else (min(lo, self._span[0]), max(hi, self._span[1]))

    # ---- admission ----------------------------------------------------------------------------------------------

    def admit(self, keys: IntArray, keep: IntArray, source: int = 0) -> Admission | None:
        """Give each of `keys` (not resident) a slot of its planned tier, evicting in policy order (never a slot in
        `keep`) until their bytes fit the budget. A demand (`source` 0) gets None, and nothing changes, when the
        evictable slots cannot make room for all of them; a prefetch (`source`: its code) admits as many of `keys`,
        in order, as room can be made for."""
        prefetch = source > 0
        sizes = self.tier_bytes[self.tier_of[keys]]
        room = self.budget - self.held_bytes
        need = int(sizes.sum()) - room
        victims = self.victims(need, keep, prefetch) if need > 0 else np.zeros(0, np.int64)
        if victims is None:
            return None
        if prefetch and need > 0:  # as many keys as fit in the room the victims make, and only the victims they need
            made = np.cumsum(self.nbytes[victims])
            n_keys = int(np.searchsorted(np.cumsum(sizes), room + (int(made[-1]) if len(made) else 0), "right"))
            keys, sizes = keys[:n_keys], sizes[:n_keys]
            need = int(sizes.sum()) - room
            victims = victims[: int(np.searchsorted(made, need)) + 1] if need > 0 else victims[:0]
        evicted = [(int(self.key[v]), int(self.source[v])) for v in victims]
        for v in victims.tolist():
            self._drop(v)
        slots = [self._assign(self._free[int(self.tier_of[k])].pop(), int(k), source) for k in keys.tolist()]
        taken = set(slots)
        return Admission(keys.tolist(), slots, evicted, [v for v in victims.tolist() if v not in taken])

    def victims(self, need: int, keep: IntArray, prefetch: bool = False) -> IntArray | None:
        """Slots to evict, cheapest first by the policy, whose bytes add up to at least `need`; never one in `keep`.
        None when all that may go holds less (a prefetch then gets all that may go)."""
        lo, hi = self._span
        ok = (self.state[lo:hi] == READY) & (self.lease[lo:hi] == 0) & ~self.hard[lo:hi] & ~self.retire[lo:hi]
        if prefetch:
            ok &= self.gen[lo:hi] < self.now_gen
        inside = keep[(keep >= lo) & (keep < hi)]
        ok[inside - lo] = False
        cand = np.flatnonzero(ok) + lo
        sizes = self.nbytes[cand]
        if int(sizes.sum()) < need:
            if not prefetch:
                return None
            need = int(sizes.sum())
        if need <= 0 or not len(cand):
            return np.zeros(0, np.int64)
        n = min(len(cand), -(-need // int(sizes.min())))  # the first n in policy order surely hold `need`
        key = self.eviction_key(cand)
        if n < len(cand):
            part = np.argpartition(key, n - 1)[:n]
            cand, key = cand[part], key[part]
        order: IntArray = cand[np.argsort(key, kind="stable")]
        return order[: int(np.searchsorted(np.cumsum(self.nbytes[order]), need)) + 1]

    def eviction_key(self, cand: IntArray) -> IntArray:
        tick = self.tick[cand]
        if self.policy == "lru":
            return tick
        if self.policy == "lfu":
            return np.asarray((self.count[self.key[cand]] << 32) + tick, np.int64)
        return np.asarray(((self.gen[cand] + self.credit[cand]) << 32) + tick, np.int64)

    def _assign(self, slot: int, key: int, source: int) -> int:
        assert self.slot_of[key] < 0 and self.state[slot] == EMPTY and self.lease[slot] == 0
        self.key[slot], self.slot_of[key] = key, slot
        self.state[slot], self.source[slot] = LOADING, source
        self.credit[slot], self.hard[slot] = self.credit_of[key], self.hard_of[key]
        self.gen[slot], self.tick[slot] = self.now_gen, self.now_tick
        self.held_bytes += int(self.nbytes[slot])
        assert self.held_bytes <= self.budget
        self.high_water = max(self.high_water, self.held_bytes)
        return slot

    def _drop(self, slot: int) -> None:
        """`slot` (not leased) holds nothing from now on; it goes on its tier's free list."""
        assert self.lease[slot] == 0
        key = int(self.key[slot])
        if key >= 0 and self.slot_of[key] == slot:
            self.slot_of[key] = -1
        if self.state[slot] != EMPTY:
            self.held_bytes -= int(self.nbytes[slot])
            self._free[int(self.tier[slot])].append(slot)
        self.key[slot], self.state[slot], self.source[slot], self.retire[slot] = -1, EMPTY, 0, False

    # ---- tiers changing, loads failing, leases ending -------------------------------------------------------------

    def stale(self, keys: IntArray) -> IntArray:
        """The slots of those `keys` resident at another tier than the applied plan now gives them."""
        have = self.slot_of[keys]
        held = have[have >= 0]
        stale: IntArray = held[self.tier[held] != self.tier_of[self.key[held]]]
        return stale

    def retire_slots(self, slots: IntArray) -> list[int]:
        """Their keys are no longer resident there (a new copy at the planned tier is admitted next); each old copy is
        freed now if nothing holds it, else once its last lease ends or its load finishes (`finish_retired`). ->
        slots freed now."""
        keys = self.key[slots]
        live = self.slot_of[keys] == slots
        self.slot_of[keys[live]] = -1
        self.retire[slots] = True
        return self.finish_retired(slots)

    def finish_retired(self, slots: IntArray) -> list[int]:
        """Free those of `slots` that are retiring and no longer leased nor loading. -> slots freed."""
        done = slots[self.retire[slots] & (self.lease[slots] == 0) & (self.state[slots] != LOADING)]
        for s in done.tolist():
            self._drop(s)
        return [int(s) for s in done]

    def loaded(self, slot: int) -> list[int]:
        """The load into `slot` finished: READY (freed at once if it was retired meanwhile). -> slots freed."""
        self.state[slot] = READY
        return self.finish_retired(np.array([slot], np.int64))

    def failed(self, slot: int) -> list[int]:
        """The load into `slot` failed: its key is not resident there; the slot is freed once its leases (passes
        that waited for the load and now see it fail) are released. -> slots freed now."""
        self.state[slot] = READY
        return self.retire_slots(np.array([slot], np.int64))

    def touch(self, keys: IntArray) -> IntArray:
        """Lease the (resident) keys' slots for one pass and mark them used now. -> their slots."""
        slots = self.slot_of[keys]
        self.lease[slots] += 1
        self.gen[slots], self.tick[slots] = self.now_gen, self.now_tick
        self.count[keys] += 1
        return slots

    def set_plan(self, pins: list[tuple[int, int]], default_tier: int, credit: int, hard: bool) -> None:
        """What a plan says of each key from now on: pins, (key, tier), at their tiers and the rest at
        `default_tier`; pins get an eviction credit of `credit` generations, or (`hard`) are never evicted, as many
        of them, in order, as half the budget holds at their tiers (the rest get the credit). Keys held at another
        tier keep their slots until their next use (`stale`)."""
        self.credit_of[:], self.hard_of[:], self.tier_of[:] = 0, False, default_tier
        hard_bytes = 0
        for key, tier in pins:
            self.tier_of[key] = tier
            size = int(self.tier_bytes[tier])
            if hard and hard_bytes + size <= self.budget // 2:
                self.hard_of[key], hard_bytes = True, hard_bytes + size
            else:
                self.credit_of[key] = credit
        held = self.key >= 0
        self.credit[held] = self.credit_of[self.key[held]]
        self.hard[held] = self.hard_of[self.key[held]]

    # ---- what is held ---------------------------------------------------------------------------------------------

    @property
    def n_held(self) -> int:
        return int(np.count_nonzero(self.state != EMPTY))

    def held_by_tier(self) -> list[int]:
        """Experts held (retiring copies too) per tier."""
        return [int(n) for n in np.bincount(self.tier[self.state != EMPTY], minlength=len(self.capacity))]

    def call_bytes(self, keys: IntArray) -> int:
        """The bytes of `keys` at their planned tiers: what one layer call needs held at once."""
        return int(self.tier_bytes[self.tier_of[keys]].sum())

    def room_for(self, present: IntArray) -> int:
        """The most bytes one call can ever have held at once: the budget less the hard-pinned experts it does not
        use (`present`: the slots it does)."""
        pinned = self.hard & (self.state != EMPTY)
        pinned[present] = False
        return self.budget - int(self.nbytes[pinned].sum())

    def n_fit(self) -> int:
        """How many experts the budget surely holds at any tier (the largest tier whose expert fits at all)."""
        return self.budget // int(self.tier_bytes[self.tier_bytes <= self.budget].max())

    def residency(self) -> Residency:
        """Copies of the per-key arrays (the caller holds the store's lock)."""
        tier = np.full(self.slot_of.size, -1, np.int8)
        held = self.slot_of >= 0
        tier[held] = self.tier[self.slot_of[held]]
        return Residency(tier, (self.credit_of > 0) | self.hard_of, self.hard_of.copy(), self.count.copy())

    def check(self) -> None:
        held = np.flatnonzero(self.state != EMPTY)
        assert (self.key[held] >= 0).all() and (self.key[self.state == EMPTY] == -1).all()
        live = held[~self.retire[held]]
        assert (self.slot_of[self.key[live]] == live).all()
        assert int((self.slot_of >= 0).sum()) == len(live)
        gone = held[self.retire[held]]
        assert ((self.lease[gone] > 0) | (self.state[gone] == LOADING)).all()
        assert self.held_bytes == int(self.nbytes[held].sum()) <= self.budget
        assert (self.lease >= 0).all()
        assert sum(len(f) for f in self._free) == int(np.count_nonzero(self.state == EMPTY))
