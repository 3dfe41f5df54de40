"""Residency policies for replay: lru, lfu, recent-k, ema:D, bandit, planner (belady lives in belady.py).

Every policy is an eviction order over the candidates a step may evict (residents the step does not need and that are
not hard-pinned); ties always fall to the older last access, then to the larger flat id. LRU-keyed policies (lru,
recent-k, planner) use the simulator's key `last access step + pin credit`.

- lru: least recent access first.
- lfu: fewest accesses so far (counts persist across evictions), then least recent.
- recent-k[:K]: LRU, plus at each segment start evict experts not used in the last K segments (K defaults to the
  number of whole decode tokens the pool holds): "keep the last k tokens resident".
- ema:D: lowest EMA score at decay D, the current segment's activations folded in as each layer runs.
- bandit: like ema, with the decay the decay bandit serves before each segment (docs/design.md#the-pager).
- planner[:score][:hard|:bias][:nowarm]: a store obeying the planner's plans: pins (credit 2 * window_k, or hard), warm
  start at the boundary (docs/design.md#the-boundary-and-the-warm-start); LRU order (the live store's) or, with `score`,
  the bandit's EMA order.
- any of these + `+ahead`: also prefetch the next-layer look-ahead's predictions during decode, those whose probability
  of use pays for the load by the live store's rule (replay.py, ahead.py); `+ahead:all`: every prediction.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from moelane.errors import MoelaneError
from moelane.pager.lab.replay import FloatArray, Policy, Simulator
from moelane.pager.plan import Plan
from moelane.pager.planner import Planner, PlannerConfig
from moelane.pager.scoreboard import DecayBandit
from moelane.pager.trace import IntArray, Segment, TraceHeader


class LRU(Policy):
    name = "lru"
    lru_keyed = True


class LFU(Policy):
    name = "lfu"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.counts = np.zeros(sim.resident.size, np.int64)

    def on_step(self, ids: IntArray, layer: int, flat: IntArray) -> None:
        self.counts[ids] += 1

    def order(self, cand: IntArray) -> IntArray:
        s = self.sim
        return np.lexsort((s.ids_desc[cand], s.last[cand], self.counts[cand]))


class RecentK(Policy):
    lru_keyed = True

    def __init__(self, k: int | None = None) -> None:
        self.k = k
        self.name = "recent-k" if k is None else f"recent-k:{k}"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        h = sim.header
        k = self.k or max(1, (sim.capacity // int(sim.tier_units[0])) // (h.n_layers * h.top_k))
        self.starts: deque[int] = deque(maxlen=k)

    def begin_segment(self, seg: Segment, flat: IntArray, decode: bool) -> None:
        s = self.sim
        if len(self.starts) == self.starts.maxlen:
            drop = np.flatnonzero(s.resident & ~s.hard & (s.last < self.starts[0]))
            s._evict(drop)
        self.starts.append(s.step)


class _Scored(Policy):
    """Evict lowest score; the current segment's activations are added as each layer runs."""

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.scores: FloatArray = np.zeros(sim.resident.size, np.float64)
        self.decay = 0.0

    def on_step(self, ids: IntArray, layer: int, flat: IntArray) -> None:
        n_tokens = flat.shape[0]
        if n_tokens == 1:
            self.scores[ids] += 1.0
            return
        ages = np.arange(n_tokens - 1, -1, -1, dtype=np.float64)
        w = np.repeat(self.decay**ages, flat.shape[2])
        self.scores += np.bincount(flat[:, layer].reshape(-1), weights=w, minlength=self.scores.size)

    def order(self, cand: IntArray) -> IntArray:
        s = self.sim
        return np.lexsort((s.ids_desc[cand], s.last[cand], self.scores[cand]))


class EMA(_Scored):
    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise MoelaneError(f"ema decay must be in [0, 1), got {decay}")
        self.fixed = decay
        self.name = f"ema:{decay:g}"

    def begin_segment(self, seg: Segment, flat: IntArray, decode: bool) -> None:
        self.decay = self.fixed
        self.scores *= self.fixed ** flat.shape[0]


class Bandit(_Scored):
    name = "bandit"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.bandit = DecayBandit(sim.resident.size)
        self.budget = max(1, sim.capacity // int(sim.tier_units[0]))

    def begin_segment(self, seg: Segment, flat: IntArray, decode: bool) -> None:
        self.decay = self.bandit.best_decay
        self.scores = self.bandit.boards.scores[self.bandit.best_arm] * self.decay ** flat.shape[0]

    def end_segment(self, seg: Segment, flat: IntArray) -> None:
        self.bandit.observe(flat.reshape(flat.shape[0], -1), self.budget)


class PlannerPolicy(Policy):
    """A store driven by a `Planner`'s plans. `order`: "lru" (the live store's order: least recent access, pins
    credited 2 * window_k tokens) or "score" (the bandit's serving-arm EMA score, pins credited 2 * window_k in score
    units: docs/pager.md, pins)."""

    def __init__(
        self,
        pin_mode: str = "bias",
        warm_start: bool = True,
        plan_path: str | None = None,
        order: str = "lru",
        **overrides: object,
    ) -> None:
        if order not in ("lru", "score"):
            raise MoelaneError(f"planner order must be lru or score, got {order!r}")
        self.overrides = {"pin_mode": pin_mode, "warm_start": warm_start, **overrides}
        self.name = "planner" + ("" if order == "lru" else ":score") + ("" if pin_mode == "bias" else f":{pin_mode}")
        self.name += "" if warm_start else ":nowarm"
        self.lru_keyed = order == "lru"
        self.n_plans = 0
        self.plan_path = plan_path  # every published plan is also written here, atomically
        self.credit = 0.0

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        budget = sim.capacity * int(sim.tier_bytes[0]) if sim.unit == "slots" else sim.capacity
        cfg = PlannerConfig.from_header(sim.header, budget_bytes=budget, **self.overrides)
        self.planner = Planner(cfg)
        self.scores: FloatArray = np.zeros(sim.resident.size, np.float64)
        self.decay = 0.0

    def _apply(self, plan: Plan | None) -> None:
        if plan is None:
            return
        self.n_plans += 1
        if self.plan_path:
            plan.write_atomic(self.plan_path)
        self.credit = 2.0 * plan.window_k
        self.sim.apply_plan(plan, credit_steps=2 * plan.window_k * self.sim.header.n_layers)

    def begin_segment(self, seg: Segment, flat: IntArray, decode: bool) -> None:
        if seg.phase == "decode":
            self._apply(self.planner.begin_decode())
        if not self.lru_keyed:
            bandit = self.planner.bandit
            self.decay = bandit.best_decay
            self.scores = bandit.boards.scores[bandit.best_arm].astype(np.float64) * self.decay ** flat.shape[0]

    def on_step(self, ids: IntArray, layer: int, flat: IntArray) -> None:
        if not self.lru_keyed:
            _Scored.on_step(self, ids, layer, flat)  # type: ignore[arg-type]

    def order(self, cand: IntArray) -> IntArray:
        s = self.sim
        keys = self.scores[cand] + self.credit * (s.bias[cand] > 0)
        return np.lexsort((s.ids_desc[cand], s.last[cand], keys))

    def end_segment(self, seg: Segment, flat: IntArray) -> None:
        self._apply(self.planner.observe(seg))


POLICY_NAMES = ("lru", "lfu", "recent-k", "belady", "ema:D", "bandit", "planner")


def make_policy(spec: str, header: TraceHeader | None = None, *, plan_path: str | None = None) -> Policy:
    """Policy from a command-line spec: lru, lfu, recent-k[:K], belady, ema:D, bandit, planner[:score][:hard][:nowarm],
    each but belady with an optional `+ahead` (prefetch the look-ahead's predictions that pay, as the live store does)
    or `+ahead:all` (every prediction).
    `header` is accepted for callers that pass it (policies read the trace header when bound); `plan_path`: the
    planner writes every published plan there, atomically."""
    for suffix in ("+ahead", "+ahead:all"):
        if spec.endswith(suffix):
            policy = make_policy(spec.removesuffix(suffix), header, plan_path=plan_path)
            if policy.name == "belady":
                raise MoelaneError("belady is the demand-only optimum; it takes no +ahead")
            policy.lookahead, policy.priced = True, suffix == "+ahead"
            policy.name += suffix
            return policy
    name, _, rest = spec.partition(":")
    args = [a for a in rest.split(":") if a]
    try:
        if name == "lru" and not args:
            return LRU()
        if name == "lfu" and not args:
            return LFU()
        if name == "recent-k" and len(args) <= 1:
            if args and int(args[0]) < 1:
                raise MoelaneError(f"bad policy {spec!r}: recent-k:K takes K >= 1 (the last K steps' experts)")
            return RecentK(int(args[0]) if args else None)
        if name == "ema" and len(args) == 1:
            return EMA(float(args[0]))
        if name == "bandit" and not args:
            return Bandit()
        if name == "belady" and not args:
            from moelane.pager.lab.belady import Belady

            return Belady()
        if name == "planner" and set(args) <= {"hard", "bias", "nowarm", "score"}:
            pin_mode = "hard" if "hard" in args else "bias"
            order = "score" if "score" in args else "lru"
            return PlannerPolicy(pin_mode, "nowarm" not in args, plan_path, order)
    except ValueError as e:
        raise MoelaneError(f"bad policy {spec!r}: {e}") from e
    raise MoelaneError(f"unknown policy {spec!r}; choose from {', '.join(POLICY_NAMES)}")
