"""Replay: run a residency policy over a trace and measure it (docs/design.md#replay-and-the-lab).

Model of execution: a segment runs layer by layer; a *step* is (segment, layer) and needs all the distinct experts
that the segment's tokens route to in that layer, resident together (a decode step needs the token's K experts). The
pool is global across layers and holds `capacity` units: slots (one per expert) or bytes (an expert's size at the tier
it was loaded at). On a step, missing experts are fetched as one batch; if they do not fit, residents that this step
does not need (and that are not hard-pinned) are evicted in the policy's order. Hit rate counts distinct experts per
step. Cost model: a step with misses stalls `latency + miss_bytes / bandwidth`; a token takes `stall + compute_floor`.

Look-ahead prefetch (a policy named `...+ahead`, on traces that carry the look-ahead): in a decode segment, once
layer l's experts are resident, the experts the look-ahead predicts for layer l+1 are loaded early as one batch
(evicting in the policy's order, never layer l's experts or hard pins), as the live store does. Which predictions
load is the live store's rule: a prediction's calibrated probability of use must reach the least at which a load
pays (ahead.py; `+ahead:all` loads every prediction). That load overlaps layer l's compute (`compute_floor / L`);
only the excess stalls. Its bytes count with the rest; `prefetched` / `prefetch_hits` / `prefetch_wasted` count the
experts it loaded, those a step then used, and those evicted before any step used them.

A segment is "decode" when labelled so, or when unlabelled ("unknown"/"mixed") and one token long; else "prefill".
Decode tokens of LRU-ordered policies are simulated a whole token at a time (vectorised over layers) when that provably
equals the step-by-step result (no victim outranks an expert a later layer of the same token reuses); otherwise, and
for all other policies, step by step. Tests check both paths against straightforward reference implementations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from moelane.errors import MoelaneError, check_number
from moelane.pager.lab.ahead import AheadPrice
from moelane.pager.lab.lrutoken import lru_token
from moelane.pager.plan import Plan
from moelane.pager.trace import IntArray, Segment, Trace, TraceHeader, token_flat_ids

FloatArray = npt.NDArray[np.float64]
DEFAULT_BANDWIDTH = 1.3e9
DEFAULT_LATENCY = 1e-4
DEFAULT_COMPUTE_FLOOR = 1.0 / 290.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Storage and compute costs. Defaults: this machine's disk (ANCHORS: O_DIRECT sequential reads 1.1-1.6 GB/s), ~0.1
    ms per positioned batch read, and a ~290 tok/s compiled decode floor for a small MoE (ANCHORS: a 115M qwen3_moe
    compiled)."""

    bandwidth: float = DEFAULT_BANDWIDTH  # bytes / s
    latency: float = DEFAULT_LATENCY  # s per batched fetch (one step's misses)
    compute_floor: float = DEFAULT_COMPUTE_FLOOR  # s per token with every expert resident

    def __post_init__(self) -> None:
        check_number("bandwidth", self.bandwidth, 0, strict=True)
        check_number("latency", self.latency, 0)
        check_number("compute_floor", self.compute_floor, 0)

    def stall(self, miss_bytes: float, n_batches: int) -> float:
        return n_batches * self.latency + miss_bytes / self.bandwidth


@dataclass(slots=True)
class PhaseStats:
    accesses: int = 0
    hits: int = 0
    bytes: int = 0
    stall_s: float = 0.0
    n_tokens: int = 0
    prefetched: int = 0
    prefetch_hits: int = 0
    prefetch_wasted: int = 0

    @property
    def misses(self) -> int:
        return self.accesses - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "accesses": self.accesses,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "bytes": self.bytes,
            "stall_s": self.stall_s,
            "n_tokens": self.n_tokens,
            "prefetched": self.prefetched,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_wasted": self.prefetch_wasted,
        }


@dataclass(slots=True, eq=False)
class ReplayResult:
    policy: str
    capacity: int
    unit: str  # "slots" or "bytes"
    prefill: PhaseStats
    decode: PhaseStats
    warm_bytes: int
    cost: CostModel
    # per decode token: hits, accesses, stall seconds, position within its request's decode (0 = first)
    token_hits: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_accesses: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))
    token_stall: FloatArray = field(default_factory=lambda: np.zeros(0, np.float64))
    token_pos: IntArray = field(default_factory=lambda: np.zeros(0, np.int64))

    def tok_s(self) -> FloatArray:
        return np.asarray(1.0 / (self.token_stall + self.cost.compute_floor), np.float64)

    def to_dict(self) -> dict[str, Any]:
        d = self.decode
        n = max(1, d.n_tokens)
        tps = self.tok_s()
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "unit": self.unit,
            "decode_hit_rate": d.hit_rate,
            "decode_misses": d.misses,
            "decode_bytes_per_token": d.bytes / n,
            "decode_stall_s_per_token": d.stall_s / n,
            "tok_s_mean": float(tps.mean()) if tps.size else 0.0,
            "tok_s_aggregate": d.n_tokens / (d.stall_s + d.n_tokens * self.cost.compute_floor) if d.n_tokens else 0.0,
            "warm_bytes": self.warm_bytes,
            "prefill": self.prefill.to_dict(),
            "decode": d.to_dict(),
        }


def is_decode(seg: Segment) -> bool:
    return seg.phase == "decode" or (seg.phase in ("unknown", "mixed") and seg.n_tokens == 1)


def layer_steps(flat: IntArray) -> list[IntArray]:
    """[T, L, K] flat ids -> per layer the distinct ids needed together."""
    if flat.shape[0] == 1:
        return [flat[0, layer] for layer in range(flat.shape[1])]
    return [np.unique(flat[:, layer]) for layer in range(flat.shape[1])]


class Policy:
    """Eviction policy hooks. `lru_keyed` policies order victims by the simulator's LRU key (with pin bias)."""

    name = "policy"
    lru_keyed = False
    lookahead = False  # prefetch the look-ahead's predictions (traces that carry them)
    priced = True  # ... those whose probability of use pays for the load (ahead.py), else all

    def bind(self, sim: Simulator) -> None:
        self.sim = sim

    def prepare(self, trace: Trace) -> None:
        """Offline policies (belady) see the whole trace before the replay."""

    def begin_segment(self, seg: Segment, flat: IntArray, decode: bool) -> None:
        """Before the segment runs (planner: boundary plan when the phase is known)."""

    def on_step(self, ids: IntArray, layer: int, flat: IntArray) -> None:
        """After a step's accesses (ids are now resident)."""

    def end_segment(self, seg: Segment, flat: IntArray) -> None:
        """After the segment ran (planner: fold it in, maybe publish a plan)."""

    def order(self, cand: IntArray) -> IntArray:
        """Eviction order over candidate ids (first evicted first); only for non-`lru_keyed` policies."""
        raise NotImplementedError


class Simulator:
    """The pool and its bookkeeping; see the module docstring for semantics."""

    def __init__(self, header: TraceHeader, capacity: int, unit: str, policy: Policy, cost: CostModel) -> None:
        if unit not in ("slots", "bytes"):
            raise ValueError(f"unit must be 'slots' or 'bytes', got {unit!r}")
        m = header.n_total
        self.header, self.capacity, self.unit, self.policy, self.cost = header, capacity, unit, policy, cost
        self.tier_bytes = np.array([b for _, b in header.tiers], np.int64)
        self.tier_units = np.ones_like(self.tier_bytes) if unit == "slots" else self.tier_bytes.copy()
        self.resident = np.zeros(m, bool)
        self.units = np.zeros(m, np.int64)  # units held by each resident expert
        self.load_tier = np.zeros(m, np.int64)  # tier an expert is loaded at (plans change it)
        self.last = np.full(m, -1, np.int64)  # step of last access
        self.bias = np.zeros(m, np.int64)  # LRU key credit in steps (pins, bias mode)
        self.hard = np.zeros(m, bool)  # never evicted (pins, hard mode)
        self.fresh = np.zeros(m, bool)  # loaded by a prefetch and not accessed since
        self.used = 0
        self.step = 0
        self.stats = {"prefill": PhaseStats(), "decode": PhaseStats()}
        self.pending_stall = 0.0
        self.warm_bytes = 0
        self.ids_desc = m - 1 - np.arange(m, dtype=np.int64)  # tie-break: larger id evicted first
        self.tokens: list[tuple[int, int, float, int]] = []
        self.tier_read: IntArray | None = None  # bytes loaded at each tier, when a report asks (`count_tiers`)
        self.ahead = AheadPrice(header.n_layers, cost.compute_floor, policy.priced)
        policy.bind(self)

    # --- keys and eviction ---
    def lru_key(self, ids: IntArray) -> IntArray:
        m = self.resident.size
        return np.asarray((self.last[ids] + self.bias[ids]) * m + self.ids_desc[ids], np.int64)

    def _victims(self, over: int, protect: IntArray, allow_hard: bool = True) -> IntArray | None:
        """Residents to evict (policy order) to free `over` units, never one in `protect`; None if impossible."""
        mask = self.resident & ~self.hard
        mask[protect] = False
        cand = np.flatnonzero(mask)
        units = self.units[cand]
        if units.sum() < over:  # hard pins yield only when the step cannot fit otherwise
            if not allow_hard:
                return None
            mask = self.resident.copy()
            mask[protect] = False
            cand = np.flatnonzero(mask)
            units = self.units[cand]
            if units.sum() < over:
                return None
        uniform = units.size == 0 or bool((units == units[0]).all())
        if self.policy.lru_keyed:
            keys = self.lru_key(cand)
            if uniform:
                n = math.ceil(over / int(units[0]))
                return cand[np.argpartition(keys, n - 1)[:n]] if n < cand.size else cand
            ordered = cand[np.argsort(keys, kind="stable")]
        else:
            ordered = cand[self.policy.order(cand)]
            if uniform:
                return ordered[: math.ceil(over / int(units[0]))]
        n = int(np.searchsorted(np.cumsum(self.units[ordered]), over)) + 1
        return ordered[:n]

    def _admit(self, miss: IntArray, protect: IntArray, early: bool = False) -> tuple[IntArray, int] | None:
        """Evict as needed and make `miss` resident; returns (victims, real bytes moved). An `early` load (prefetch)
        never evicts hard pins and returns None when it does not fit."""
        need = self.tier_units[self.load_tier[miss]]
        over = self.used + int(need.sum()) - self.capacity
        victims = self._victims(over, protect, allow_hard=not early) if over > 0 else np.zeros(0, np.int64)
        if victims is None:
            if early:
                return None
            raise MoelaneError(
                f"pool of {self.capacity} {self.unit} too small: a step needs more than fits beside its pins"
            )
        self._evict(victims)
        self.resident[miss] = True
        self.units[miss] = need
        self.used += int(need.sum())
        self._count_tiers(miss)
        return victims, int(self.tier_bytes[self.load_tier[miss]].sum())

    def count_tiers(self) -> None:
        """From now on, add the bytes of every load to its tier in `tier_read`."""
        self.tier_read = np.zeros(self.tier_bytes.size, np.int64)

    def _count_tiers(self, loaded: IntArray) -> None:
        if self.tier_read is not None and loaded.size:
            np.add.at(self.tier_read, self.load_tier[loaded], self.tier_bytes[self.load_tier[loaded]])

    def _evict(self, victims: IntArray) -> None:
        wasted = int(self.fresh[victims].sum())
        if wasted:
            self.stats["decode"].prefetch_wasted += wasted  # (only decode segments prefetch)
            self.ahead.outcome(False, wasted)
        self.used -= int(self.units[victims].sum())
        self.resident[victims] = False
        self.units[victims] = 0
        self.fresh[victims] = False

    # --- running ---
    def run_step(self, ids: IntArray, phase: PhaseStats) -> float:
        hit = self.resident[ids]
        miss = ids[~hit]
        stall = 0.0
        if miss.size:
            admitted = self._admit(miss, ids)
            assert admitted is not None
            moved = admitted[1]
            phase.bytes += moved
            stall = self._disk(moved, miss.size)
        phase.accesses += ids.size
        phase.hits += int(hit.sum())
        used = int(self.fresh[ids].sum())
        if used:
            phase.prefetch_hits += used
            self.ahead.outcome(True, used)
        self.fresh[ids] = False
        self.last[ids] = self.step
        self.step += 1
        return stall

    def _disk(self, moved: int, n_loads: int) -> float:
        """Disk time of one batch of `n_loads` experts, `moved` bytes (the price sees each its share)."""
        seconds = self.cost.stall(moved, 1)
        self.ahead.read(seconds, n_loads)
        return seconds

    def prefetch(self, predicted: IntArray, protect: IntArray, phase: PhaseStats) -> float:
        """Load what pays of the [T, K] flat ids predicted for the next layer, early, while the current layer
        computes; returns the stall beyond that layer's compute."""
        ids, p = self.ahead.choose(predicted)
        miss = ids[~self.resident[ids]]
        if not miss.size:
            return 0.0
        admitted = self._admit(miss, np.concatenate([protect, ids]), early=True)
        if admitted is None:
            return 0.0
        moved = admitted[1]
        phase.bytes += moved
        phase.prefetched += int(miss.size)
        self.ahead.issued(int(miss.size), p)
        self.fresh[miss] = True
        self.last[miss] = self.step
        overlap = self.cost.compute_floor / self.header.n_layers
        return max(0.0, self._disk(moved, miss.size) - overlap)

    def _token_fast(self, flat: IntArray, phase: PhaseStats) -> float | None:
        """Whole decode token at once (LRU-keyed policies), exactly as step by step; None: run the steps."""
        n_layers = flat.shape[1]
        ids = flat.reshape(-1)
        load_units = self.tier_units[self.load_tier[ids]]
        free = self.capacity - self.used
        out = lru_token(flat[0], self.resident, self.hard, self.units, load_units, self.last, self.bias, free)
        if out is None:
            return None
        self._evict(out.evicted)
        miss = ids[~out.hit]
        self._count_tiers(miss)
        self.resident[miss] = True
        self.units[miss] = load_units[~out.hit]
        self.used += int(load_units[~out.hit].sum())
        assert self.capacity - self.used == out.free_after
        per_layer = (self.tier_bytes[self.load_tier[ids]] * ~out.hit).reshape(n_layers, -1).sum(axis=1)
        phase.accesses += ids.size
        phase.hits += int(out.hit.sum())
        phase.bytes += int(per_layer.sum())
        self.last[flat[0]] = self.step + np.arange(n_layers, dtype=np.int64)[:, None]
        self.step += n_layers
        if type(self.policy).on_step is not Policy.on_step:
            for layer in range(n_layers):
                self.policy.on_step(flat[0, layer], layer, flat)
        return float((per_layer > 0).sum() * self.cost.latency + per_layer.sum() / self.cost.bandwidth)

    def run_segment(self, seg: Segment, pos: int) -> None:
        flat = token_flat_ids(seg.expert_ids, self.header.n_experts)
        decode = is_decode(seg)
        phase = self.stats["decode" if decode else "prefill"]
        self.policy.begin_segment(seg, flat, decode)
        ahead = None
        if self.policy.lookahead and decode and seg.lookahead is not None:
            ahead = token_flat_ids(seg.lookahead, self.header.n_experts) + self.header.n_experts  # layers 1..L-1
        stall = None
        if decode and self.policy.lru_keyed and flat.shape[0] == 1 and ahead is None:
            stall = self._token_fast(flat, phase)
        if stall is None:
            stall = 0.0
            for layer, ids in enumerate(layer_steps(flat)):
                stall += self.run_step(ids, phase)
                self.policy.on_step(ids, layer, flat)
                if ahead is not None:
                    self.ahead.routed(ids)
                    if layer < ahead.shape[1]:
                        stall += self.prefetch(ahead[:, layer], ids, phase)
        if decode:
            stall += self.pending_stall
            self.pending_stall = 0.0
            n_hits = phase.hits
            self.tokens.append((n_hits, phase.accesses, stall, pos))
        phase.stall_s += stall
        phase.n_tokens += seg.n_tokens
        self.ahead.end_pass(stall + seg.n_tokens * self.cost.compute_floor)
        self.policy.end_segment(seg, flat)

    # --- plans (planner policies) ---
    def apply_plan(self, plan: Plan, credit_steps: int) -> None:
        e = self.header.n_experts
        pins = np.array([layer * e + x for layer, x, _ in plan.pins], np.int64)
        self.bias[:] = 0
        self.hard[:] = False
        self.load_tier[:] = plan.default_tier
        if pins.size:
            tiers = np.array([plan.default_tier if t is None else t for _, _, t in plan.pins], np.int64)
            self.load_tier[pins] = tiers
            if plan.pin_mode == "hard":
                self.hard[pins] = True
            else:
                self.bias[pins] = credit_steps
        if plan.warm:
            self.warm_load(np.array([layer * e + x for layer, x in plan.warm], np.int64))

    def warm_load(self, ids: IntArray) -> None:
        """Load `ids` (most wanted first) before the next decode token, as one batch; they become most recent."""
        held = np.where(self.resident[ids], self.units[ids], self.tier_units[self.load_tier[ids]])
        stuck = self.resident & self.hard
        stuck[ids] = False
        want = ids[np.cumsum(held) <= self.capacity - int(self.units[stuck].sum())]
        miss = want[~self.resident[want]]
        if miss.size:
            admitted = self._admit(miss, want)
            assert admitted is not None
            moved = admitted[1]
            self.warm_bytes += moved
            self.stats["decode"].bytes += moved
            self.pending_stall += self._disk(moved, miss.size)
        self.last[want] = self.step
        self.step += 1


def replay(
    trace: Trace,
    policy: Policy,
    capacity: int,
    unit: str = "slots",
    cost: CostModel | None = None,
    after_segment: Callable[[Simulator, Segment], None] | None = None,
) -> ReplayResult:
    """Run `policy` over `trace` with a pool of `capacity` slots or bytes; `after_segment(sim, seg)`, if given, is
    called after each segment has run (a report samples the simulator's counters there)."""
    cost = cost or CostModel()
    if policy.lookahead and trace.lookahead is None:
        raise MoelaneError(
            f"policy {policy.name} prefetches the look-ahead, but this trace does not carry it "
            "(record it with `moelane trace record`, whose traces do where the model's routers allow)"
        )
    sim = Simulator(trace.header, capacity, unit, policy, cost)
    if after_segment is not None:
        sim.count_tiers()
    policy.prepare(trace)
    decode_pos: dict[int, int] = {}
    for seg in trace.segments():
        stream = int(seg.stream_ids[0]) if seg.n_tokens else -1
        pos = decode_pos.get(stream, 0)
        if seg.phase == "prefill":
            decode_pos[stream] = 0
            pos = 0
        sim.run_segment(seg, pos)
        if is_decode(seg):
            decode_pos[stream] = pos + 1
        if after_segment is not None:
            after_segment(sim, seg)
    toks = np.array(sim.tokens, np.float64).reshape(-1, 4)
    hits_cum = toks[:, 0].astype(np.int64)
    acc_cum = toks[:, 1].astype(np.int64)
    return ReplayResult(
        policy=policy.name,
        capacity=capacity,
        unit=unit,
        prefill=sim.stats["prefill"],
        decode=sim.stats["decode"],
        warm_bytes=sim.warm_bytes,
        cost=cost,
        token_hits=np.diff(np.concatenate([[0], hits_cum])),
        token_accesses=np.diff(np.concatenate([[0], acc_cum])),
        token_stall=toks[:, 2],
        token_pos=toks[:, 3].astype(np.int64),
    )
