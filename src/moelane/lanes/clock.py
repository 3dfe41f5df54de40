"""Time, injected. Every place in the lanes engine that reads time reads it from a `Clock`, so that the scheduler,
the depth rule and the guard can be tested with a fake clock whose time moves only when a test (or the fake target
model) says so.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin; never decreases."""
        ...


class RealClock:
    """Wall-clock time from `time.perf_counter`."""

    def now(self) -> float:
        return time.perf_counter()


class FakeClock:
    """A clock that moves only by `advance`. The fake target model advances it by the price of each pass."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._t += seconds
