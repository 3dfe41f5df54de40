"""The state parts of a `/v1/stats` sample (stats.py's `PagerView` and `LanesView`, as plain data), read from what
the expert store and the lanes engine already keep: the store's counters (`PagerStats.to_dict`), its applied plan,
the live planner's decay bandit, its per-expert residency (`ExpertStore.residency`), `Engine.stats()` and the guard.

Invariants: reads only; the one lock taken is the store's, once, inside `residency()` (a copy of a few arrays of
layers x experts); a number that is not finite (a rate measured over no time) becomes null, so the JSON stays JSON.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from moelane.pager.live.tiers import TIER_NAMES

PHASES = ("decode", "prefill")
NO_PAGER = "no pager (all experts resident): routing counts are not kept"


def finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def store_of(lm: Any) -> Any:
    """The LM's expert store, or None where every expert is resident."""
    provider = getattr(lm, "provider", None)
    return provider if callable(getattr(provider, "residency", None)) else None


def pager_view(lm: Any, counters: dict[str, Any] | None) -> dict[str, Any] | None:
    """PagerView of `lm` (None for a model without experts); `counters`: its store's `PagerStats.to_dict()`."""
    store = store_of(lm)
    if store is None:
        handles = getattr(lm, "expert_handles", None)
        if not handles:
            return None
        layers = sorted(handles)
        n_experts = len(handles[layers[0]])
        zeros = [[0] * n_experts for _ in layers]
        heatmap = {"layers": layers, "n_experts": n_experts, "tiers": list(TIER_NAMES), "tier": zeros,
                   "pinned": zeros, "counts": None}  # fmt: skip
        return {"paged": False, "note": NO_PAGER, "policy": None, "n_slots": None, "slot_bytes": None,
                "budget_bytes": None, "resident_bytes": None, "total_bytes": None, "phases": {}, "reads": [],
                "evictions": 0, "plan": None, "bandit": None, "heatmap": heatmap}  # fmt: skip
    d = counters or {}
    residency = store.residency()
    shape = (len(store.layers), store.n_experts)
    heatmap = {"layers": list(store.layers), "n_experts": store.n_experts, "tiers": list(TIER_NAMES),
               "tier": residency.tier.reshape(shape).tolist(),
               "pinned": (residency.pinned.astype(np.int64) + residency.hard).reshape(shape).tolist(),
               "counts": residency.count.reshape(shape).tolist()}  # fmt: skip
    reads = [{"level": key.partition("/")[0], "tier": key.partition("/")[2], "bytes": int(n),
              "experts": int(d.get("experts_read", {}).get(key, 0))}
             for key, n in sorted(d.get("bytes_read", {}).items())]  # fmt: skip
    return {
        "paged": True, "note": None, "policy": store.config.policy, "n_slots": store.n_slots,
        "slot_bytes": store.slot_bytes, "budget_bytes": store.config.budget_bytes,
        "resident_bytes": store.resident_bytes, "total_bytes": store.total_bytes,
        "phases": {name: {**c, "hit_rate": c["found"] / c["accesses"] if c["accesses"] else None}
                   for name, c in pass_phases(d).items()},
        "reads": reads, "evictions": int(d.get("evictions", 0)),
        "plan": plan_view(store, int(residency.hard.sum())), "bandit": bandit_view(store), "heatmap": heatmap,
    }  # fmt: skip


def pass_phases(counters: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Accesses found resident, accesses and stall seconds of decode and prefill passes since start: the server's
    ledger's split (`pass_phases`: prefill, the passes in which a stream fed prompt rows), else the store's own
    (which calls any pass of several rows prefill)."""
    d = counters or {}
    out = {phase: {"found": 0, "accesses": 0, "stall_s": 0.0} for phase in PHASES}
    if "pass_phases" in d:
        for name, c in d["pass_phases"].items():
            into = out["decode" if name == "decode" else "prefill"]
            for key in into:
                into[key] += c[key]
    else:
        for name, c in d.get("by_phase", {}).items():
            into = out["decode" if name == "decode" else "prefill"]
            into["found"] += c.get("hits", 0) + c.get("prefetch_hits", 0)
            into["accesses"] += c.get("hits", 0) + c.get("prefetch_hits", 0) + c.get("misses", 0)
            into["stall_s"] += c.get("stall_s", 0.0)
    for c in out.values():
        c["found"], c["accesses"] = int(c["found"]), int(c["accesses"])
    return out


def plan_view(store: Any, n_hard: int) -> dict[str, Any] | None:
    plan = store.plan
    if plan is None:
        return None
    live = store.live_planner
    return {"version": live.n_plans if live is not None else None, "budget_bytes": plan.budget_bytes,
            "n_pins": len(plan.pins), "n_hard": n_hard, "window_k": plan.window_k, "pin_mode": plan.pin_mode,
            "default_tier": TIER_NAMES[plan.default_tier]}  # fmt: skip


def bandit_view(store: Any) -> dict[str, Any] | None:
    """The live planner's decay bandit: each arm's weight and the serving arm (None before its first segment, or
    without a planner: policies lru and lfu)."""
    planner = getattr(store.live_planner, "planner", None)
    if planner is None:
        return None
    bandit = planner.bandit
    weights = np.array(bandit.rewards, np.float64)  # (the planner's thread replaces the array whole: one copy)
    return {"decays": [round(float(d), 6) for d in bandit.boards.decays], "weights": weights.tolist(),
            "serving": int(np.argmax(weights))}  # fmt: skip


def lanes_view(engine: Any, s: Any) -> dict[str, Any]:
    """LanesView of `engine`, whose `stats()` gave `s`."""
    config = getattr(engine, "config", None)
    guard = getattr(engine, "guard", None)
    return {
        "drafter": getattr(config, "drafter", "none"), "max_streams": getattr(config, "max_streams", 0),
        "active": s.n_active, "waiting": s.n_waiting, "rounds": s.rounds, "committed": s.committed,
        "prefill_tokens": s.prefill_tokens, "holds": s.holds, "accepted": s.accepted,
        "acceptance": s.accepted / s.holds if s.holds else None,
        "guard": None if guard is None else guard_rows(guard, s.guard_modes),
    }  # fmt: skip


def guard_rows(guard: Any, modes: dict[int, str]) -> list[dict[str, Any]]:
    """The guard's verdict per stream count it has seen (`modes`: `Engine.stats().guard_modes`, its keys)."""
    rows = []
    for n in modes:
        e = guard.entry(n)
        rows.append({"streams": n, "mode": e.mode, "state": "running" if e.running else "measuring",
                     "rounds_left": e.left, "rate_plain": finite(e.rate_plain) if e.rate_plain else None,
                     "rate_drafted": finite(e.rate_drafted) if e.rate_drafted else None,
                     "decisions": e.n_decisions})  # fmt: skip
    return rows
