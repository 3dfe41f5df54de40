"""`EngineConfig`: the lanes engine's settings, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from moelane.errors import integer
from moelane.lanes.depth import DEFAULT_PRICES

DRAFTERS = ("none", "copy", "recall", "model")
COUNTS = ("max_streams", "max_depth", "max_rows", "prefill_chunk", "min_match", "recall_tokens", "prefix_cache_mb")
FLAGS = ("guard", "timed", "overlap", "compile_draft")  # guard may be None too


def finite(name: str, value: object) -> float:
    """`value` as a float; ValueError naming `name` unless it is a finite real number (not a bool)."""
    if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """
    drafter:       "none", "copy" (context copy), "recall" (copy + earlier replies), "model" (the draft model).
    guard:         the shared guard; None: on for the draft-model drafter only. It runs only when `timed`.
    timed:         True: round prices are measured (at start-up and as rounds run) and the guard may run;
                   False: prices come from `prices` / `draft_price` only and nothing depends on a clock.
    max_streams:   streams holding a KV cache and taking part in rounds; later submissions wait in a queue.
    max_depth:     most draft rows one stream holds in a round.
    max_rows:      most rows in one forward pass.
    prefill_chunk: most prompt tokens one stream feeds in a round.
    prices:        untimed price table: (rows, cost) points, interpolated.
    draft_price:   untimed cost of one draft-model pass, in the units of `prices`.
    min_match:     shortest backward match the copy and recall drafters act on.
    recall_tokens: tokens kept in the recall store.
    overlap:       run each forward pass on a worker thread while the engine thread does the host work that does
                   not depend on it (admitting and indexing streams).
    compile_draft: compile the decode step of the draft model the engine loads itself (drafter "model" without a
                   `draft` given): a draft level is then one compiled call.
    prefix_cache_mb: MiB of K/V that finished streams' caches may keep, beside the live streams' positions, for
                   requests that start with the same tokens (`moelane.lanes.prefix`; as much again for the draft
                   model's caches); 0: none kept.
    """

    drafter: str = "none"
    guard: bool | None = None
    timed: bool = True
    max_streams: int = 16
    max_depth: int = 8
    max_rows: int = 256
    prefill_chunk: int = 64
    prices: tuple[tuple[int, float], ...] = DEFAULT_PRICES
    draft_price: float = 0.5
    min_match: int = 6
    recall_tokens: int = 1 << 20
    overlap: bool = False
    compile_draft: bool = True
    prefix_cache_mb: int = 512

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}; got {self.drafter!r}")
        for name in COUNTS:  # (plain ints from here on: a NaN or 2.5 would fail every round, not here)
            object.__setattr__(self, name, integer(name, getattr(self, name)))
        for name in FLAGS:  # (a truthy "no" would turn a setting on)
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "guard" and value is None):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        try:
            pairs = [(n, c) for n, c in self.prices]
        except (TypeError, ValueError):
            raise ValueError(f"prices must be (rows, cost) pairs, got {self.prices!r}") from None
        prices = tuple((integer("prices rows", n), finite("prices cost", c)) for n, c in pairs)
        object.__setattr__(self, "prices", prices)
        object.__setattr__(self, "draft_price", finite("draft_price", self.draft_price))
        for name in ("max_streams", "max_rows", "prefill_chunk", "min_match", "recall_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        if self.max_depth < 0:
            raise ValueError(f"max_depth must be >= 0, got {self.max_depth}")
        if self.max_rows < self.max_streams:
            raise ValueError(f"max_rows ({self.max_rows}) must be at least max_streams ({self.max_streams})")
        if self.min_match < 3:
            raise ValueError(f"min_match must be >= 3 (the index is of 3-grams), got {self.min_match}")
        if not self.prices or any(n < 1 or c <= 0 for n, c in self.prices):
            raise ValueError(f"prices need (rows >= 1, cost > 0) points, got {self.prices}")
        if self.draft_price < 0:
            raise ValueError(f"draft_price must be >= 0, got {self.draft_price}")

    @property
    def guard_on(self) -> bool:
        """Whether the engine consults the guard at all."""
        wanted = self.drafter == "model" if self.guard is None else self.guard
        return wanted and self.timed and self.drafter != "none"
