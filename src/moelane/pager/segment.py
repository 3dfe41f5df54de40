"""Prefill -> decode boundary detection from segment sizes alone (docs/design.md#the-boundary-and-the-warm-start).

A segment's size is the number of distinct experts one forward pass routes to. Prefill segments route many tokens and
touch many experts; a decode segment routes one token. The detector fires exactly once, on the first segment whose
size is strictly below `ratio` (0.8) times the smallest size seen before it; the running minimum is updated after the
check. Consequences, pinned by tests: the first segment never fires (nothing seen before it), so a serve that starts
decode-sized never fires; once fired, later small segments (a partial last token) never fire again.
"""

from __future__ import annotations

import math


class PrefillBoundaryDetector:
    """`observe(size) -> bool`: True exactly once, on the boundary segment."""

    def __init__(self, ratio: float = 0.8) -> None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        self.ratio = ratio
        self._min_size = math.inf
        self._fired = False

    @property
    def fired(self) -> bool:
        return self._fired

    def observe(self, size: int) -> bool:
        if size < 0:
            raise ValueError(f"segment size must be >= 0, got {size}")
        fire = not self._fired and self._min_size < math.inf and size < self.ratio * self._min_size
        self._min_size = min(self._min_size, size)
        if fire:
            self._fired = True
        return fire
