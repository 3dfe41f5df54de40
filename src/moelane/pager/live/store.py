"""The live expert store, the pager's mechanism (docs/design.md, "The store"): an `ExpertProvider` with pools under one
hard byte budget.

Pools: one per precision tier (pools.py), each in the tier's format (native: the compute dtype; int8, int4: codes and
scales as the tier file stores them), shared by all MoE layers; `pools(layer)` returns them all, `slots(layer, ids)`
global slot numbers. Each expert is admitted at the tier the applied plan gives it (its pin's tier, else the plan's
`default_tier`; before any plan, `StoreConfig.default_tier`) and held in its slot at that tier, so a lower tier holds
more experts in the same bytes. One budget for all tiers: the slot table (slots.py) counts the bytes of every held
slot and admits an expert only after evicting, in policy order across tiers, until its bytes fit, so held bytes never
pass the budget (`high_water_bytes`, checked under load by the tests); a slot freed and not reused at once returns
its pages, so the process's resident memory follows the held bytes.

`slots(layer, ids)` (the only per-layer Python on the hot path): under one lock it leases the routed experts' slots,
evicts and admits the misses as one batch, marks them loading; outside the lock the misses are read in parallel
(storage.py) straight into their slots; it then waits for its own and any in-flight loads. `slots_staged` (what eager
MoE dispatch calls) returns before that wait, with the pairs still loading marked, so the resident experts compute
while the misses load; the stall counted is only the time then spent waiting. At tier 0 a slot holds exactly
`read_expert(handle, dtype)`, so greedy tokens equal the all-resident run bitwise; at a quantised tier it holds exactly
the tier file's codes and scales.

Tiers changing: a resident expert whose planned tier changed is re-admitted at the new tier at its next demand use (a
miss there). Its old copy leaves the table's live entries at once and is freed as soon as no lease holds it (at once
when none does); while a pass still computes on it, both copies count against the budget. Prefetches leave such
experts alone.

Leases (why a slot being computed on is never overwritten): every slot handed out by `slots` is leased by the calling
thread and cannot be a victim until released. A thread's lease is released at its next `slots` call (its previous MoE
layer has finished computing by then: one thread runs one pass's layers in order), by the post-block hook `attach`
installs, by `release()`, or when the thread has died. A thread that waits for room holds no lease (it releases its
old lease first and leases nothing until its whole batch fits), so waiting threads cannot deadlock each other.

Room: one layer call needs the bytes of all its experts, at their planned tiers, held at once. When they fit in the
budget less the hard-pinned experts it does not use, the call waits (holding nothing) until other passes' leases and
loads leave that much evictable, which they do when they end; when they do not fit, waiting cannot help and it raises
`StoreError`. `max_rows` is the prefill chunk whose experts always fit, counted at the largest tier the store can hold.

Eviction (`policy`): "planner" (the source's): the oldest token generation first, then least recent access; a token
generation is one pass, counted at each `slots` call of the first MoE layer; pins from the applied plan get a credit of
`2 * window_k` generations ("bias") or are never evicted ("hard", at most half the budget's bytes). "lru" and "lfu"
ignore pins and serve as baselines. Prefetches (prefetch.py) only evict slots not used in the current generation, load
at the planned tier, and never wait.

On a device (`device`: a CUDA device): the pools are device memory, allocated once (the budget); a load fills a
pinned staging buffer and is copied into its slot on one copy stream, its future completing once the copy is
enqueued; `slots`, `slots_staged` and a staged call's wait make the caller's stream wait for the copy events of
exactly the slots they hand out that are still being copied; a lease's end records an event on the stream it was
taken on, which the next copy into any of its slots waits for (transfer.py: the mechanics and their invariants).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moelane.errors import MoelaneError
from moelane.model.checkpoint import ExpertHandle
from moelane.model.provider import TierPool, native_weights
from moelane.pager.live.pools import TierPools
from moelane.pager.live.prefetch import Attachment, FetchPool, LivePlanner, RoutingListener, attach
from moelane.pager.live.slots import LOADING, Admission, IntArray, Residency, SlotTable
from moelane.pager.live.stats import PagerStats
from moelane.pager.live.storage import Storage
from moelane.pager.live.tiers import TIER_NAMES, expert_slot_bytes, tier_format
from moelane.pager.live.transfer import make_transfer, on_device
from moelane.pager.plan import Plan
from moelane.pager.planner import PlannerConfig
from moelane.pager.price import LoadPrice

POLICIES = ("planner", "lru", "lfu")
# Misses of experts smaller than this (at the default tier) are read by the computing thread itself, one after
# another: from the page cache a 110 KB expert decodes in ~130 us alone, but four at once on the I/O threads took
# ~2.2 ms (they and the computing thread queue for the GIL between torch ops). Larger reads go to the I/O threads,
# in parallel, while the resident experts compute.
SMALL_EXPERT_BYTES = 1 << 20


def _nothing() -> None:
    """The wait of a call whose experts were all resident."""


NOTHING = Admission([], [], [], [])
NEVER_STALE = 1 << 62  # the generation a prefetch with no set pass is for  # (a call with no misses admits nothing)


Key = int  # flat expert id: layer index * E + expert


class StoreError(MoelaneError):
    """A store setting that cannot work (a budget too small for one layer's experts, a bad policy or tier)."""


@dataclass(frozen=True, slots=True)
class StoreConfig:
    budget_bytes: int  # every tier's pool together: the bytes of the experts held, each at its tier
    host_bytes: int = 0  # host-RAM copies of stored forms (0: every miss reads storage)
    policy: str = "planner"
    default_tier: int = 0
    pin_mode: str = "bias"
    window_k: int = 4
    io_threads: int = 4
    check_finite: bool = True  # reject experts whose weights read back non-finite (a corrupt shard)

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or self.host_bytes < 0:
            raise ValueError(f"bad budgets: pool {self.budget_bytes}, host {self.host_bytes} bytes")
        if self.policy not in POLICIES:
            raise ValueError(f"pager policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.default_tier < len(TIER_NAMES):
            raise ValueError(f"default tier must be one of {', '.join(TIER_NAMES)}, got {self.default_tier}")
        if self.pin_mode not in ("bias", "hard") or self.window_k < 1 or self.io_threads < 0:
            raise ValueError(
                f"bad pin_mode {self.pin_mode!r}, window_k {self.window_k} or io_threads {self.io_threads}"
            )


class ExpertStore:
    def __init__(
        self, handles: dict[int, list[ExpertHandle]], dtype: torch.dtype, config: StoreConfig, progress: bool = False,
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        """`device`: where the pools live (None or the CPU: host memory; a CUDA device: transfer.py)."""
        self.config, self.dtype, self.device = config, dtype, on_device(device)
        self.layers = sorted(handles)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self._handles = [handles[layer] for layer in self.layers]
        self.n_experts = len(self._handles[0])
        if any(len(hs) != self.n_experts for hs in self._handles):
            raise StoreError("every MoE layer must have the same number of routed experts")
        self._dims = self._handles[0][0].dims  # (hidden, width)
        self.tier_bytes = tuple(expert_slot_bytes(t, handles, dtype) for t in range(len(TIER_NAMES)))
        self.slot_bytes = self.tier_bytes[config.default_tier]  # one expert at the default tier
        n_total = len(self.layers) * self.n_experts
        self.total_bytes = n_total * self.tier_bytes[0]  # all experts in the compute dtype (what "100%" means)
        capacity = [config.budget_bytes // b for b in self.tier_bytes]
        if capacity[config.default_tier] < 1:
            raise StoreError(f"expert memory of {config.budget_bytes} bytes holds no expert ({self.slot_bytes} bytes "
                             f"at tier {TIER_NAMES[config.default_tier]})")  # fmt: skip
        self.table = SlotTable(capacity, self.tier_bytes, config.budget_bytes, n_total, config.policy,
                               config.default_tier)  # fmt: skip
        formats = {t: tier_format(t, handles) for t in range(1, len(TIER_NAMES))}
        largest = max(b for b in self.tier_bytes if b <= config.budget_bytes)  # (the largest slot it may load)
        self.transfer = make_transfer(self.device, largest, config.io_threads + 2)  # (+ the computing thread's loads)
        self._pools = TierPools(self._dims, dtype, self.table.first.tolist(), self.table.capacity.tolist(), formats,
                                self.device)  # fmt: skip
        self._futures: dict[int, Future[None]] = {}  # slot -> its load in flight
        self._leases: dict[threading.Thread, tuple[IntArray, Any]] = {}  # -> (slots, what they are read on)
        self.plan: Plan | None = None
        self.stats = PagerStats()
        self.sources: list[str] = []
        self.listeners: list[RoutingListener] = []
        self.live_planner: LivePlanner | None = None
        self._attachment: Attachment | None = None
        self._cond = threading.Condition()
        self._local = threading.local()
        self._phase_now = "prefill"  # of the pass begun last (what prefetches' disk reads are counted to)
        self.price = LoadPrice(len(self.layers))  # when a prefetch pays (price.py)
        self._queued: dict[int, tuple[Key, int]] = {}  # slot -> (key, generation it is for): prefetches not started
        self._routed_gen = np.full(len(self.layers), -1, np.int64)  # per layer, the last generation that routed it
        self._reading = 0  # loads reading now
        self._pass_start: float | None = None
        self.storage = Storage(handles, config.host_bytes, config.check_finite, progress, self.transfer)
        try:
            self.storage.tier_source(config.default_tier)  # (its tier file built now, at load, not on the first miss)
        except BaseException:
            self.storage.close()
            raise
        self._use_tier(config.default_tier)
        self._pool = FetchPool(config.io_threads)

    @property
    def n_slots(self) -> int:
        """How many experts the budget holds at the default tier (at most all of them)."""
        return min(int(self.table.capacity[self.config.default_tier]), int(self.table.slot_of.size))

    # ---- the provider protocol ----------------------------------------------------------------------------------

    def pools(self, layer: int) -> tuple[TierPool, ...]:
        """Every tier's pool made so far (the same for every layer: slots are global)."""
        return self._pools.tier_pools

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return native_weights(self._pools.tier_pools)

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        return self._route(layer, expert_ids, staged=False)[0]

    def slots_staged(
        self, layer: int, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[], None]]:
        """`slots` without waiting for the misses of experts of SMALL_EXPERT_BYTES or more: they load on the I/O
        threads while the caller computes the resident experts. -> (slots, pending [same shape] bool or None if
        nothing is loading, wait)."""
        return self._route(layer, expert_ids, staged=True)

    def _route(
        self, layer: int, expert_ids: torch.Tensor, staged: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[], None]]:
        """Route one layer call; unless `staged` (and the experts big enough), wait for its loads before returning."""
        li = self._index[layer]
        base = li * self.n_experts
        flat = expert_ids.reshape(-1).cpu().numpy()  # (routed on a device: the table is host-side)
        keys = np.unique(flat) + base
        phase = getattr(self._local, "phase", None) or ("decode" if expert_ids.shape[0] == 1 else "prefill")
        if li == 0:
            self._new_generation(phase)
        if phase == "prefill" and (counts := getattr(self._local, "prefill_keys", None)) is not None:
            for k in keys.tolist():
                counts[k] = counts.get(k, 0) + 1
        start = time.perf_counter()
        self._time_layer(li, phase, start)
        slots, jobs, waits = self._acquire(li, keys, phase)
        small = self.slot_bytes < SMALL_EXPERT_BYTES  # (at the default tier)
        staged = staged and not small  # small experts: nothing worth hiding, they are read here one after another
        self._start_loads(jobs, phase, n_here=len(jobs) if small else 0 if staged else 1)
        if self.listeners:
            routed = keys.tolist()
            for listener in self.listeners:
                listener.routed(li, routed)
        lut = np.zeros(self.n_experts, np.int64)
        lut[keys - base] = slots
        out = torch.from_numpy(lut[flat]).view(expert_ids.shape)
        if not waits:
            self.transfer.ready(slots)
            return out, None, _nothing
        futures = [fut for _, fut in waits]
        if not staged:
            self._wait(futures, phase, start, slots)
            return out, None, _nothing
        late = [slot for slot, _ in waits]
        pending = torch.from_numpy(np.isin(lut[flat], late)).view(expert_ids.shape)
        self.transfer.ready(slots, late)
        return out, pending, functools.partial(self._wait, futures, phase, None, late)  # only the wait itself stalls

    # ---- slot decisions (under the lock) -------------------------------------------------------------------------

    def _time_layer(self, li: int, phase: str, start: float) -> None:
        """A one-row decode pass's compute from the previous MoE layer's call to this one's, stalls excluded (what
        a load wanted by the next layer can hide behind: `price.LoadPrice`)."""
        local = self._local
        if phase == "decode" and li > 0 and getattr(local, "prev_li", -1) == li - 1:
            with self._cond:
                self.price.observe_layer(max(0.0, start - local.prev_start - local.stall))
        local.prev_li, local.prev_start, local.stall = li, start, 0.0

    def _acquire(
        self, li: int, keys: IntArray, phase: str
    ) -> tuple[IntArray, list[tuple[int, Key]], list[tuple[int, Future[None]]]]:
        """Lease every routed expert's slot, admitting the misses (and experts resident at another tier than
        planned) as one batch; prefetches of them still queued are this call's own loads now (a demand never waits
        behind the prefetch queue). -> (slots, loads to run, (slot, load) pairs to wait for)."""
        thread, t = threading.current_thread(), self.table
        with self._cond:
            self._release_locked(thread)
            self._routed_gen[li] = t.now_gen
            t.now_tick += 1
            while True:
                stale = t.stale(keys)
                if len(stale):
                    self._free_pages_locked(t.retire_slots(stale))
                have = t.slot_of[keys]
                missing = keys[have < 0]
                admission = t.admit(missing, have[have >= 0]) if len(missing) else NOTHING
                if admission is not None:
                    break
                self._check_room_locked(keys, have[have >= 0])
                self._reap_dead_locked()
                self._cond.wait(0.05)
            counts = [stats.phase(phase) for stats in self._targets()]
            present = have[have >= 0]
            claimed = [s for s in present.tolist() if s in self._queued] if self._queued else []
            sources = t.source[present]
            n_prefetched = int(np.count_nonzero(sources))
            for c in counts:
                c.hits += len(present) - n_prefetched
                c.prefetch_hits += n_prefetched - len(claimed)
                c.misses += len(missing) + len(claimed)
                c.layer_calls += 1
            if n_prefetched:
                for slot, src in zip(present.tolist(), sources.tolist(), strict=True):
                    if src:
                        counts_of = self.stats.source(self.sources[src - 1])
                        if slot in self._queued:
                            counts_of.late += 1
                        else:
                            counts_of.used += 1
                            self.price.observe_outcome(self.sources[src - 1], True)
                t.source[present] = 0
            loading = present[t.state[present] == LOADING].tolist() if self._futures else []
            waits = [(s, self._futures[s]) for s in loading]
            jobs = self._admitted_locked(admission) + [(s, self._queued.pop(s)[0]) for s in claimed]
            waits += [(slot, self._futures[slot]) for slot, _ in jobs if slot not in claimed]
            slots = t.touch(keys)
            self._leases[thread] = (slots, self.transfer.reader())
            return slots, jobs, waits

    def _check_room_locked(self, keys: IntArray, present: IntArray) -> None:
        """StoreError if this call's experts can never be held at once (so waiting for room would never end)."""
        need, room = self.table.call_bytes(keys), self.table.room_for(present)
        if need > room:
            raise StoreError(
                f"one MoE layer call needs {len(keys)} experts at once ({need} bytes at their tiers) but the expert "
                f"memory holds {room} bytes for them; raise --expert-memory or prefill in smaller chunks"
            )

    def _admitted_locked(self, admission: Admission) -> list[tuple[int, Key]]:
        """Count an admission's evictions, give each admitted slot a future to wait on, return the pages of the
        victims not reused. -> the loads to run, (slot, key)."""
        for _, old_source in admission.evicted:
            self.stats.evictions += 1
            if old_source:
                self.stats.source(self.sources[old_source - 1]).wasted += 1
                self.price.observe_outcome(self.sources[old_source - 1], False)
        self._free_pages_locked(admission.freed)
        for slot in admission.slots:
            self._futures[slot] = Future()
        return list(zip(admission.slots, admission.keys, strict=True))

    def _free_pages_locked(self, slots: list[int]) -> None:
        """Return the pages of these emptied slots (before any later admission can write them: under the lock)."""
        self._pools.release(slots, self.table.tier, self.table.state)

    def _use_tier(self, tier: int) -> None:
        """Experts may be admitted at `tier` from now on (its pool is made once)."""
        with self._cond:
            self._pools.use(tier)
            self.table.use_tier(tier)

    def _release_locked(self, thread: threading.Thread) -> None:
        lease = self._leases.pop(thread, None)
        if lease is not None and len(lease[0]):
            slots, reader = lease
            self.transfer.released(slots, reader)  # (before the slots can be victims: transfer.py, invariant 1)
            self.table.lease[slots] -= 1
            self._free_pages_locked(self.table.finish_retired(slots))
            self._cond.notify_all()

    def _reap_dead_locked(self) -> None:
        for thread in [t for t in self._leases if not t.is_alive()]:
            self._release_locked(thread)

    def release(self) -> None:
        """Release the calling thread's lease (its last layer has computed)."""
        with self._cond:
            self._release_locked(threading.current_thread())

    # ---- loads (outside the lock) --------------------------------------------------------------------------------

    def _start_loads(self, jobs: list[tuple[int, Key]], phase: str, n_here: int) -> None:
        """Run this call's misses: the last `n_here` on this thread (its caller waits for them anyway), the rest on
        the I/O threads."""
        targets = self._targets()
        n_pool = max(0, len(jobs) - n_here)
        for slot, key in jobs[:n_pool]:
            self._pool.submit(0, functools.partial(self._load, slot, key, targets, phase))
        for slot, key in jobs[n_pool:]:
            self._load(slot, key, targets, phase)

    def _wait(self, futures: list[Future[None]], phase: str, start: float | None, slots: IntArray | list[int]) -> None:
        """Wait for a call's loads, then make the caller's stream wait for the copies into `slots` (transfer.py); the
        stall counted runs from `start` (default: now)."""
        start = time.perf_counter() if start is None else start
        try:
            for fut in futures:
                fut.result()
        except BaseException:
            self.release()
            raise
        self.transfer.ready(slots)
        stall = time.perf_counter() - start
        self._local.stall = getattr(self._local, "stall", 0.0) + stall
        with self._cond:
            for stats in self._targets():
                stats.phase(phase).stall_s += stall

    def _load(self, slot: int, key: Key, targets: list[PagerStats], phase: str) -> None:
        """Read `key` at its slot's tier into the slot; complete (or fail) the slot's future. `phase`: of the pass
        that issued the load (its disk bytes are counted to it)."""
        handle = self._handles[key // self.n_experts][key % self.n_experts]
        tier = int(self.table.tier[slot])
        with self._cond:
            self._reading += 1
            concurrent = self._reading
        start = time.perf_counter()
        try:
            fill = functools.partial(self.storage.load_into, handle, tier)
            level, n_bytes = self.transfer.load(slot, self._pools.slot(tier, slot), fill)
        except BaseException as e:
            with self._cond:
                self._reading -= 1
                fut = self._futures.pop(slot)
                self._free_pages_locked(self.table.failed(slot))
                self._cond.notify_all()
            fut.set_exception(e)
            return
        seconds = time.perf_counter() - start
        with self._cond:
            self._reading -= 1
            if level == "disk":
                self.price.observe_read(seconds, max(concurrent, self._reading + 1))
            fut = self._futures.pop(slot)
            self._free_pages_locked(self.table.loaded(slot))
            for stats in targets:
                stats.add_read(level, TIER_NAMES[tier], n_bytes, seconds)
                if level == "disk":
                    stats.add_disk(phase, n_bytes)
            self._cond.notify_all()
        fut.set_result(None)

    # ---- prefetch, generations, plans ----------------------------------------------------------------------------

    def prefetch(self, layer: int, experts: Iterable[int], source: str, ahead: int = 0, p: float | None = None) -> int:
        """Start loading these experts of `layer` in the background where a slot is free or stale; never waits.
        -> loads started."""
        base = self._index[layer] * self.n_experts
        return self.prefetch_keys([base + int(e) for e in experts], source, ahead, p)

    def prefetch_threshold(self, ahead: int, source: str | None = None) -> float:
        """The least probability of use at which a prefetch by `source` for `ahead` passes later pays
        (price.py)."""
        return self.price.threshold(ahead, source)

    def prefetch_keys(self, keys: Iterable[Key], source: str, ahead: int | None = 0, p: float | None = None) -> int:
        """Start loading these experts (at their planned tiers) where room can be made without waiting; experts
        resident at any tier are left as they are. Each is for the pass `ahead` of the one begun last: still queued
        when that pass has routed its layer without it, it is dropped unread (None: for any later pass, never
        dropped). `p`: the probability of use the source gave them (its loads' yield is then measured). -> loads
        started."""
        with self._cond:
            if source not in self.sources:
                self.sources.append(source)
            code = self.sources.index(source) + 1
            missing = np.asarray(list(dict.fromkeys(k for k in keys if self.table.slot_of[k] < 0)), np.int64)
            admission = self.table.admit(missing, missing[:0], source=code) if len(missing) else NOTHING
            assert admission is not None
            jobs = self._admitted_locked(admission)
            self.stats.source(source).issued += len(jobs)
            if p is not None:
                for _ in jobs:
                    self.price.observe_issue(source, p)
            target = NEVER_STALE if ahead is None else self.table.now_gen + ahead
            for slot, key in jobs:
                self._queued[slot] = (key, target)
        for slot, _ in jobs:
            self._pool.submit(1, functools.partial(self._run_prefetch, slot))
        return len(jobs)

    def _run_prefetch(self, slot: int) -> None:
        """A queued prefetch's turn: load it, unless a demand took it over (it is that call's load now) or it went
        stale (the pass it was for routed its layer without it: the slot is freed unread)."""
        with self._cond:
            entry = self._queued.pop(slot, None)
            if entry is None:
                return
            key, target = entry
            if self._routed_gen[key // self.n_experts] < target:
                phase = self._phase_now
            else:
                fut = self._futures.pop(slot)
                name = self.sources[int(self.table.source[slot]) - 1]
                self.stats.source(name).dropped += 1
                self.price.observe_outcome(name, False)
                self._free_pages_locked(self.table.failed(slot))
                self._cond.notify_all()
                fut.set_result(None)
                return
        self._load(slot, key, [self.stats], phase)

    def count_prediction(self, source: str, predicted: int, correct: int, routed: int) -> None:
        with self._cond:
            counts = self.stats.source(source)
            counts.predicted, counts.correct, counts.routed = (
                counts.predicted + predicted,
                counts.correct + correct,
                counts.routed + routed,
            )

    def _new_generation(self, phase: str) -> None:
        """A pass begins (first MoE layer): a new token generation; at a prefill -> decode switch, warm the pool."""
        local, now = self._local, time.perf_counter()
        with self._cond:
            self.table.now_gen += 1
            self._phase_now = phase
            if self._pass_start is not None:
                self.price.observe_pass(now - self._pass_start)
            self._pass_start = now
            for stats in self._targets():
                stats.passes[phase] = stats.passes.get(phase, 0) + 1
        boundary = getattr(local, "last_phase", None) == "prefill" and phase == "decode"
        local.last_phase = phase
        if boundary and self.live_planner is not None:
            self.live_planner.begin_decode()  # its boundary plan carries the warm list
        elif boundary:
            self.warm_start(getattr(local, "prefill_keys", None))
            local.prefill_keys = None
        elif phase == "prefill":
            local.prefill_keys = getattr(local, "prefill_keys", None) or {}

    def warm_start(self, prefill_counts: dict[Key, int] | None = None) -> int:
        """Before decode token 1, refill the pool with the plan's warm list, else the most-routed experts of the prefill
        just finished, up to half the slots (docs/design.md, "The boundary and the warm start")."""
        if self.plan is not None and self.plan.warm:
            keys = [self._index[la] * self.n_experts + e for la, e in self.plan.warm if la in self._index]
        elif prefill_counts:
            keys = sorted(prefill_counts, key=lambda k: -prefill_counts[k])
        else:
            return 0
        return self.prefetch_keys(keys[: self.n_slots // 2], "warm", None)

    def apply(self, plan: Plan) -> None:
        """Obey a published plan from now on: pins (bias credit or hard), pin tiers, default tier, warm list. Experts
        resident at another tier than the plan now gives them move at their next use (module docstring)."""
        tiers = {plan.default_tier, *(t for _, _, t in plan.pins if t is not None)}
        for tier in tiers:
            if tier >= len(TIER_NAMES):
                raise StoreError(f"plan asks for precision tier {tier}; this store has {len(TIER_NAMES)} tiers")
            if self.tier_bytes[tier] > self.config.budget_bytes:
                raise StoreError(f"plan asks for tier {TIER_NAMES[tier]}, whose experts ({self.tier_bytes[tier]} "
                                 f"bytes) are larger than the expert memory ({self.config.budget_bytes} "
                                 "bytes)")  # fmt: skip
            self.storage.tier_source(tier)
            self._use_tier(tier)
        pins = [(self._index[layer] * self.n_experts + expert, plan.default_tier if tier is None else tier)
                for layer, expert, tier in plan.pins if layer in self._index and expert < self.n_experts]  # fmt: skip
        with self._cond:
            if self.config.policy == "planner":
                self.table.set_plan(pins, plan.default_tier, 2 * plan.window_k, plan.pin_mode == "hard")
            else:  # (baselines: tiers only)
                self.table.set_plan(pins, plan.default_tier, 0, False)
            self.plan = plan
        if plan.warm:
            self.warm_start()

    # ---- phases, per-request statistics, lifetime ----------------------------------------------------------------

    def _targets(self) -> list[PagerStats]:
        request = getattr(self._local, "request", None)
        return [self.stats] if request is None else [self.stats, request]

    @contextmanager
    def track(self) -> Iterator[PagerStats]:
        """Count this thread's accesses and reads into a fresh `PagerStats` too (one request's statistics)."""
        request = PagerStats()
        self._local.request = request
        try:
            yield request
        finally:
            self._local.request = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label this thread's passes (else: one row is "decode", more is "prefill")."""
        self._local.phase = name
        try:
            yield
        finally:
            self._local.phase = None

    @property
    def resident_bytes(self) -> int:
        """The bytes of the experts held now, each at its tier (loads in flight and copies being retired included)."""
        return self.table.held_bytes

    @property
    def high_water_bytes(self) -> int:
        """The most expert bytes ever held at once (counted at every admission)."""
        return self.table.high_water

    def held_by_tier(self) -> dict[str, int]:
        """Experts held now, by tier name."""
        with self._cond:
            return dict(zip(TIER_NAMES, self.table.held_by_tier(), strict=True))

    def expert_parts(self, slot: int) -> tuple[str, tuple[torch.Tensor, ...]]:
        """The tier name and the tensors of pool slot `slot` (w13, w2; or codes13, scales13, codes2, scales2)."""
        tier = int(self.table.tier[slot])
        return TIER_NAMES[tier], self._pools.slot(tier, slot)

    def residency(self) -> Residency:
        """Which experts are held, at which tier, pinned, and how often used: copies taken under the lock, for a
        dashboard's sample (at most once a second), never on the per-token path."""
        with self._cond:
            return self.table.residency()

    def check_invariants(self) -> None:
        """Slot table and expert table agree; nothing over budget (tests call this)."""
        with self._cond:
            self.table.check()
            assert self.high_water_bytes <= self.config.budget_bytes

    def wait_loads(self) -> None:
        """Wait until no load (demand or prefetch) is in flight."""
        with self._cond:
            self._cond.wait_for(lambda: not self._futures, timeout=60)

    def max_rows(self, top_k: int) -> int:
        """Most rows one pass may route through a MoE layer so that its experts surely fit the budget at any tier a
        plan may give them (the largest whose expert fits at all): a prefill chunk limit for small budgets,
        unlimited when one layer's experts all fit."""
        n_fit = self.table.n_fit()
        return 1 << 30 if n_fit >= self.n_experts else max(1, n_fit // max(1, top_k))

    def attach(self, lm: Any, lookahead: bool = True, cooc: bool = True, planner: bool | None = None) -> Attachment:
        """Hook a loaded LM: release leases right after each MoE block, run the predictors, and (by default when
        the policy is "planner") drive the planner from the LM's routing and obey its plans."""
        self._attachment = attach(
            lm, self, lookahead, cooc, self.config.policy == "planner" if planner is None else planner
        )
        return self._attachment

    def planner_config(self, top_k: int, **overrides: Any) -> PlannerConfig:
        """The planner's settings for this store: its shape, a pool slot's bytes per tier (native: in the compute
        dtype), the pool's byte budget, the store's default tier and pin mode."""
        settings: dict[str, Any] = dict(
            n_layers=len(self.layers), n_experts=self.n_experts, top_k=top_k, tier_bytes=self.tier_bytes,
            budget_bytes=self.config.budget_bytes, default_tier=self.config.default_tier,
            pin_mode=self.config.pin_mode,
        )  # fmt: skip
        return PlannerConfig(**{**settings, **overrides})

    def close(self) -> None:
        """Stop every thread of the store (fetches, predictors, the live planner) and close its files. Before the
        process exits: a thread still running torch work while the interpreter shuts down aborts it ("terminate
        called without an active exception", exit code 134: 3 of ~67 runs of `moelane run --expert-memory 30%`)."""
        if self._attachment is not None:
            self._attachment.detach()
            self._attachment = None
        self._pool.close()
        self.storage.close()
