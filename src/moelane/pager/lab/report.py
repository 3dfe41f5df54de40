"""A recorded trace as the dashboard's pager views: the object `GET /v1/stats` answers (docs/server.md,
"Dashboard"), with `axis` "tokens" and no lanes or requests, which `moelane trace analyze --html` draws into one
self-contained page.

The planner is replayed over the trace with a pool of `capacity` experts (replay.py's cost model gives the stall and
the bytes read, at one storage level); the replay's counters are sampled about `points` times, by tokens replayed,
each point a rate over the tokens since the one before: hit rates of decode and prefill tokens, stall per token,
bytes read per token by tier, the bandit's serving arm and the plan's version. At the end: the pool's residency, the
tier each resident expert was loaded at and the plan's pins, with each expert's routing count over the whole trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from moelane.pager.lab.policies import PlannerPolicy
from moelane.pager.lab.replay import CostModel, Simulator, is_decode, replay
from moelane.pager.trace import IntArray, Segment, Trace

POINTS = 300
LEVEL = "storage"  # the replay's one storage level (its cost model's bandwidth and latency)
STATE_FIELDS = ("tok_s", "rounds_s", "rows_per_round", "active", "waiting", "acceptance")  # (no lanes in a trace)


@dataclass(frozen=True, slots=True)
class Totals:
    """The replay's cumulative counters after `tokens` tokens."""

    tokens: int
    found: dict[str, int]  # phase -> accesses found resident
    accesses: dict[str, int]
    stall_s: float
    tier_read: IntArray  # bytes loaded per tier


def totals(sim: Simulator, tokens: int) -> Totals:
    assert sim.tier_read is not None
    phases = sim.stats
    return Totals(tokens, {k: c.hits for k, c in phases.items()}, {k: c.accesses for k, c in phases.items()},
                  sum(c.stall_s for c in phases.values()), sim.tier_read.copy())  # fmt: skip


class Sampler:
    """`after_segment` for `replay`: a point each time another `every` tokens have been replayed."""

    def __init__(self, every: int) -> None:
        self.every, self.tokens, self.next_at = every, 0, every
        self.points: list[dict[str, Any]] = []
        self._last: Totals | None = None
        self._prefill = False

    def __call__(self, sim: Simulator, seg: Segment) -> None:
        self.tokens += seg.n_tokens
        self._prefill |= not is_decode(seg)
        if self.tokens >= self.next_at:
            self.take(sim)
            self.next_at = self.tokens + self.every

    def take(self, sim: Simulator) -> None:
        """A point for the tokens since the last one."""
        now = totals(sim, self.tokens)
        last = self._last or Totals(0, {}, {}, 0.0, np.zeros_like(now.tier_read))
        n = max(1, now.tokens - last.tokens)
        policy = sim.policy
        assert isinstance(policy, PlannerPolicy)
        bandit = policy.planner.bandit
        point: dict[str, Any] = {
            "t": float(now.tokens), "prefill": self._prefill,
            "stall_ms_per_token": 1000 * (now.stall_s - last.stall_s) / n,
            "serving_decay": round(float(bandit.boards.decays[bandit.best_arm]), 6),
            "plan_version": policy.n_plans if policy.planner.plan is not None else None,
            "read_rate": {f"{LEVEL}/{name}": float(b - a) / n for (name, _), a, b
                          in zip(sim.header.tiers, last.tier_read.tolist(), now.tier_read.tolist(), strict=True)},
            **dict.fromkeys(STATE_FIELDS),
        }  # fmt: skip
        for phase in ("decode", "prefill"):
            accesses = now.accesses[phase] - last.accesses.get(phase, 0)
            found = now.found[phase] - last.found.get(phase, 0)
            point[f"hit_rate_{phase}"] = found / accesses if accesses else None
        self.points.append(point)
        self._last, self._prefill = now, False


def trace_views(trace: Trace, capacity: int, cost: CostModel | None = None, points: int = POINTS) -> dict[str, Any]:
    """The dashboard's object for `trace` replayed under the planner with a pool of `capacity` expert slots."""
    h = trace.header
    n_tokens = int(trace.expert_ids.shape[0])
    sampler = Sampler(max(1, -(-n_tokens // points)))
    policy = PlannerPolicy()
    result = replay(trace, policy, capacity, "slots", cost, after_segment=sampler)
    sim = policy.sim
    if sampler.tokens > (sampler.points[-1]["t"] if sampler.points else 0):
        sampler.take(sim)
    keys = [k for p in sampler.points for k in p["read_rate"] if any(q["read_rate"][k] for q in sampler.points)]
    series: dict[str, Any] = {name: [p[name] for p in sampler.points] for name in
                              ("t", "hit_rate_decode", "hit_rate_prefill", "stall_ms_per_token", "prefill",
                               "serving_decay", "plan_version", *STATE_FIELDS)}  # fmt: skip
    series["read_rate"] = {k: [p["read_rate"][k] for p in sampler.points] for k in dict.fromkeys(keys)}
    assert sim.tier_read is not None
    reads = [{"level": LEVEL, "tier": name, "bytes": int(n), "experts": int(n // size)}
             for (name, size), n in zip(h.tiers, sim.tier_read.tolist(), strict=True) if n]  # fmt: skip
    now = time.time()
    return {
        "object": "moelane.stats", "version": 1, "model": h.model or "trace", "axis": "tokens", "now": now,
        "started": now, "interval_s": 1.0, "show_text": False, "series": series,
        "pager": pager_view(trace, sim, policy, result.prefill.to_dict(), result.decode.to_dict(), reads),
        "lanes": None, "requests": None,
    }  # fmt: skip


def pager_view(trace: Trace, sim: Simulator, policy: PlannerPolicy, prefill: dict[str, Any], decode: dict[str, Any],
               reads: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The replay's pool at the end of the trace, as the schema's `PagerView`."""
    h = trace.header
    shape = (h.n_layers, h.n_experts)
    counts = np.zeros(h.n_total, np.int64)
    flat = trace.expert_ids.astype(np.int64) + np.arange(h.n_layers, dtype=np.int64)[None, :, None] * h.n_experts
    np.add.at(counts, flat.reshape(-1), 1)
    tier = np.where(sim.resident, sim.load_tier, -1)
    pinned = (sim.bias > 0).astype(np.int64) + 2 * sim.hard
    planner, plan = policy.planner, policy.planner.plan
    bandit = planner.bandit
    heatmap = {"layers": list(h.moe_layers) or list(range(h.n_layers)), "n_experts": h.n_experts,
               "tiers": [name for name, _ in h.tiers], "tier": tier.reshape(shape).tolist(),
               "pinned": pinned.reshape(shape).tolist(), "counts": counts.reshape(shape).tolist()}  # fmt: skip
    phases = {name: {"found": c["hits"], "accesses": c["accesses"], "stall_s": c["stall_s"],
                     "hit_rate": c["hit_rate"] if c["accesses"] else None}
              for name, c in (("decode", decode), ("prefill", prefill))}  # fmt: skip
    return {
        "paged": True, "note": f"replayed: planner, pool of {sim.capacity} of {h.n_total} experts",
        "policy": policy.name, "n_slots": sim.capacity, "slot_bytes": h.expert_bytes,
        "budget_bytes": sim.capacity * h.expert_bytes, "resident_bytes": int(sim.resident.sum()) * h.expert_bytes,
        "total_bytes": h.n_total * h.expert_bytes, "phases": phases, "reads": reads, "evictions": None,
        "plan": None if plan is None else {
            "version": policy.n_plans, "budget_bytes": plan.budget_bytes, "n_pins": len(plan.pins),
            "n_hard": int(sim.hard.sum()), "window_k": plan.window_k, "pin_mode": plan.pin_mode,
            "default_tier": h.tiers[plan.default_tier][0]},
        "bandit": {"decays": [round(float(d), 6) for d in bandit.boards.decays], "weights": bandit.rewards.tolist(),
                   "serving": bandit.best_arm},
        "heatmap": heatmap,
    }  # fmt: skip
