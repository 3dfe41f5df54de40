"""The plan: what the pager's policy publishes for the residency mechanism (docs/design.md#the-plan-seam).

A `Plan` is plain data. Mechanism and policy meet only here, so either side can be replaced, replayed or simulated
against the other. Invariants: `budget_bytes > 0`, `window_k >= 1`, pins are distinct `(layer, expert)` ids, tiers are
indices into the precision ladder (0 = the checkpoint's own dtype). A plan without tier fields (every pin tier `None`,
`default_tier == 0`) is exactly the plain residency plan.

JSON form (written atomically by `write_atomic`; see docs/trace-format.md, "Plan files"):

    {"version": 1, "budget_bytes": 123, "window_k": 4, "default_tier": 0, "pin_mode": "bias",
     "pins": [[layer, expert, tier_or_null], ...], "warm": [[layer, expert], ...]}
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLAN_VERSION = 1
PIN_MODES = ("bias", "hard")

Pin = tuple[int, int, int | None]


@dataclass(frozen=True, slots=True)
class Plan:
    """Residency plan.

    budget_bytes: the resident pool's byte budget.
    window_k:     recency window in tokens; a pin's eviction credit is `2 * window_k` tokens (pin_mode "bias").
    pins:         `(layer, expert, tier | None)`; `None` means "at default_tier".
    default_tier: precision tier of the whole unpinned cold tail.
    pin_mode:     "bias" (pins get an eviction credit) or "hard" (pins are never evicted).
    warm:         experts to load before decode token 1, most wanted first (set only on the boundary plan:
                  docs/design.md#the-boundary-and-the-warm-start).
    """

    budget_bytes: int
    window_k: int
    pins: tuple[Pin, ...] = ()
    default_tier: int = 0
    pin_mode: str = "bias"
    warm: tuple[tuple[int, int], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {self.budget_bytes}")
        if self.window_k < 1:
            raise ValueError(f"window_k must be >= 1, got {self.window_k}")
        if self.default_tier < 0:
            raise ValueError(f"default_tier must be >= 0, got {self.default_tier}")
        if self.pin_mode not in PIN_MODES:
            raise ValueError(f"pin_mode must be one of {PIN_MODES}, got {self.pin_mode!r}")
        if self.pins:
            bad = [p for p in self.pins if p[0] < 0 or p[1] < 0 or (p[2] is not None and p[2] < 0)]
            if bad:
                raise ValueError(f"bad pin {bad[0]}")
            if len({(p[0], p[1]) for p in self.pins}) != len(self.pins):
                raise ValueError("a pin is given twice")

    def pin_ids(self) -> frozenset[tuple[int, int]]:
        return frozenset((layer, expert) for layer, expert, _ in self.pins)

    def same_residency(self, other: Plan | None) -> bool:
        """True when `other` asks for the same budget, pins and tiers (the publish-only-on-change test)."""
        return (
            other is not None
            and self.budget_bytes == other.budget_bytes
            and self.default_tier == other.default_tier
            and self.pin_mode == other.pin_mode
            and set(self.pins) == set(other.pins)
        )

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "version": PLAN_VERSION,
            "budget_bytes": self.budget_bytes,
            "window_k": self.window_k,
            "default_tier": self.default_tier,
            "pin_mode": self.pin_mode,
            "pins": [list(p) for p in self.pins],
            "warm": [list(w) for w in self.warm],
        }
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        body = json.loads(text)
        if body.get("version") != PLAN_VERSION:
            raise ValueError(f"unsupported plan version {body.get('version')!r}")
        return cls(
            budget_bytes=int(body["budget_bytes"]),
            window_k=int(body["window_k"]),
            pins=tuple((int(p[0]), int(p[1]), None if p[2] is None else int(p[2])) for p in body.get("pins", [])),
            default_tier=int(body.get("default_tier", 0)),
            pin_mode=str(body.get("pin_mode", "bias")),
            warm=tuple((int(w[0]), int(w[1])) for w in body.get("warm", [])),
        )

    def write_atomic(self, path: str | os.PathLike[str]) -> None:
        """Write the JSON form so that a reader sees either the old file or the whole new one (rename is atomic)."""
        target = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or Path("."))
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
