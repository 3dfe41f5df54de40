"""The planner: decay bandit + pins + warm start at the prefill -> decode boundary
(docs/design.md#the-boundary-and-the-warm-start).

Pure policy: `observe(segment) -> Plan | None` after each forward pass, and `begin_decode() -> Plan | None` for engines
that know when prefill ends. No I/O, no clock. Defaults are the constants the design was measured with (docs/pager.md).

- Budget: `budget_bytes`, or 1.5x the first observed segment's size (at the default tier) when none is given.
- Pins: the serving arm's top `n_pins` experts, capped at half the budget (the other half stays for the recency
  window); optional precision tier `pin_tier`; the cold tail at `default_tier`.
- window_k: how many whole decode tokens fit in the unpinned part of the budget (at least 1).
- Rewrite every `rewrite_every` segments; a rewrite is published only when budget, pins or tiers changed.
- Boundary (labelled phase: the first decode segment of a request; otherwise `PrefillBoundaryDetector` on segment
  sizes): with `warm_start`, a plan is published at once, computed before the boundary segment is folded in, with
  `warm` = pins, then the prefill tail (last prefill segment), then the most-routed prefill experts, capped to the
  budget: the experts to load before decode token 1. Without `warm_start` the boundary changes nothing.
- A prefill segment after the boundary (or, unlabelled, a change of stream ids) starts a new request: the detector
  re-arms and the prefill statistics restart; the bandit's scores carry over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moelane.pager.plan import PIN_MODES, Plan
from moelane.pager.scoreboard import ARMS, REWARD_RATE, DecayBandit
from moelane.pager.segment import PrefillBoundaryDetector
from moelane.pager.trace import IntArray, Segment, TraceHeader, token_flat_ids


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    n_layers: int
    n_experts: int
    top_k: int
    tier_bytes: tuple[int, ...]  # bytes per expert at each precision tier, tier 0 first
    budget_bytes: int | None = None
    arms: tuple[float, ...] = ARMS
    reward_rate: float = REWARD_RATE
    rewrite_every: int = 8
    n_pins: int = 256
    pin_mode: str = "bias"
    pin_tier: int | None = None
    default_tier: int = 0
    warm_start: bool = True
    boundary_ratio: float = 0.8

    def __post_init__(self) -> None:
        if self.n_layers < 1 or self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"bad shape L={self.n_layers} E={self.n_experts} K={self.top_k}")
        if not self.tier_bytes or any(b <= 0 for b in self.tier_bytes):
            raise ValueError(f"tier_bytes must be non-empty and positive, got {self.tier_bytes}")
        if not 0 <= self.default_tier < len(self.tier_bytes):
            raise ValueError(f"default_tier {self.default_tier} is not a tier of {self.tier_bytes}")
        if self.pin_tier is not None and not 0 <= self.pin_tier < len(self.tier_bytes):
            raise ValueError(f"pin_tier {self.pin_tier} is not a tier of {self.tier_bytes}")
        if self.budget_bytes is not None and self.budget_bytes < self.tier_bytes[self.default_tier]:
            raise ValueError(f"budget_bytes {self.budget_bytes} holds no expert")
        if self.rewrite_every < 1 or self.n_pins < 0:
            raise ValueError("rewrite_every must be >= 1 and n_pins >= 0")
        if self.pin_mode not in PIN_MODES:
            raise ValueError(f"pin_mode must be one of {PIN_MODES}, got {self.pin_mode!r}")

    @classmethod
    def from_header(cls, header: TraceHeader, **overrides: object) -> PlannerConfig:
        return cls(
            n_layers=header.n_layers,
            n_experts=header.n_experts,
            top_k=header.top_k,
            tier_bytes=tuple(b for _, b in header.tiers),
            **overrides,  # type: ignore[arg-type]
        )


class Planner:
    """Decay-bandit planner. See the module docstring for the contract."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.n_ids = config.n_layers * config.n_experts
        self.bandit = DecayBandit(self.n_ids, config.arms, config.reward_rate)
        self.budget_bytes = config.budget_bytes
        self.plan: Plan | None = None
        self._last_pins: IntArray = np.zeros(0, np.int64)
        self._since_rewrite = 0
        self._new_request(None)

    def _new_request(self, streams: frozenset[int] | None) -> None:
        self.detector = PrefillBoundaryDetector(self.config.boundary_ratio)
        self.at_decode = False
        self._streams = streams
        self._prefill_counts = np.zeros(self.n_ids, np.int64)
        self._prefill_tail: IntArray = np.zeros(0, np.int64)

    @property
    def budget_slots(self) -> int:
        """How many experts the budget holds at the default tier (the bandit's prediction size)."""
        assert self.budget_bytes is not None
        return max(1, self.budget_bytes // self.config.tier_bytes[self.config.default_tier])

    def begin_decode(self) -> Plan | None:
        """The engine says prefill is over: the boundary plan now (once per request), or None."""
        if self.at_decode:
            return None
        return self._boundary()

    def observe(self, segment: Segment) -> Plan | None:
        """Fold in one forward pass; return a plan when one is published."""
        c = self.config
        flat = token_flat_ids(segment.expert_ids, c.n_experts).reshape(segment.n_tokens, -1)
        single = segment.n_tokens == 1  # one token's ids are distinct: no unique needed
        size = flat.shape[1] if single else int(np.unique(flat).size)
        self._maybe_new_request(segment)
        if self.budget_bytes is None:
            self.budget_bytes = max(1, math.ceil(1.5 * size)) * c.tier_bytes[c.default_tier]
        published = self._boundary() if self._is_boundary(segment, size) else None
        self.bandit.observe(flat, self.budget_slots)
        if not self.at_decode:
            self._prefill_counts += np.bincount(flat.reshape(-1), minlength=self.n_ids)
            self._prefill_tail = np.unique(flat)
        self._since_rewrite += 1
        if published is None and self._since_rewrite >= c.rewrite_every:
            published = self._rewrite()
        return published

    def _maybe_new_request(self, segment: Segment) -> None:
        sids = segment.stream_ids
        streams = frozenset((int(sids[0]),) if sids.size == 1 else np.unique(sids).tolist())
        labelled_restart = segment.phase == "prefill" and self.at_decode
        unlabelled_restart = segment.phase in ("unknown", "mixed") and self._streams not in (None, streams)
        if labelled_restart or unlabelled_restart:
            self._new_request(streams)
        self._streams = streams

    def _is_boundary(self, segment: Segment, size: int) -> bool:
        fired = self.detector.observe(size)
        if self.at_decode:
            return False
        if segment.phase in ("prefill", "decode"):
            return segment.phase == "decode"
        return fired

    def _boundary(self) -> Plan | None:
        self.at_decode = True
        if not self.config.warm_start or self.budget_bytes is None:
            return None
        self._since_rewrite = 0
        self.plan = self._make_plan(with_warm=True)
        return self.plan

    def _rewrite(self) -> Plan | None:
        self._since_rewrite = 0
        pin_ids = self._pin_ids()
        if self.plan is not None and np.array_equal(pin_ids, self._last_pins) and self._same_budget():
            return None
        plan = self._make_plan(with_warm=False, pin_ids=pin_ids)
        if plan.same_residency(self.plan):
            return None
        self.plan = plan
        return plan

    def _pin_ids(self) -> IntArray:
        """The serving arm's top experts, at most half the budget (sorted by rank)."""
        c = self.config
        assert self.budget_bytes is not None
        pin_bytes = c.tier_bytes[c.default_tier if c.pin_tier is None else c.pin_tier]
        n_pins = min(c.n_pins, (self.budget_bytes // 2) // pin_bytes)
        return self.bandit.boards.top(self.bandit.best_arm, n_pins) if n_pins else np.zeros(0, np.int64)

    def _same_budget(self) -> bool:
        return self.plan is not None and self.plan.budget_bytes == self.budget_bytes

    def _make_plan(self, with_warm: bool, pin_ids: IntArray | None = None) -> Plan:
        c = self.config
        assert self.budget_bytes is not None
        pin_ids = self._pin_ids() if pin_ids is None else pin_ids
        self._last_pins = pin_ids
        per_token = c.n_layers * c.top_k
        window_k = max(1, (self.budget_slots - pin_ids.size) // per_token)
        E = c.n_experts
        pins = tuple(zip((pin_ids // E).tolist(), (pin_ids % E).tolist(), [c.pin_tier] * pin_ids.size, strict=True))
        warm: tuple[tuple[int, int], ...] = ()
        if with_warm:
            warm = tuple((int(i) // E, int(i) % E) for i in self._warm_ids(pin_ids))
        return Plan(self.budget_bytes, window_k, pins, c.default_tier, c.pin_mode, warm)

    def _warm_ids(self, pin_ids: IntArray) -> IntArray:
        counts = self._prefill_counts
        routed = np.flatnonzero(counts > 0)
        by_count = routed[np.lexsort((routed, -counts[routed]))]
        ordered = np.concatenate([pin_ids, self._prefill_tail, by_count])
        _, first = np.unique(ordered, return_index=True)
        return np.asarray(ordered[np.sort(first)][: self.budget_slots], np.int64)
