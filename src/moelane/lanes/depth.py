"""The depth rule: how many draft rows each stream holds in a round.

Each stream keeps its acceptance by depth, `p[k]` = chance that draft k lands given that drafts 0..k-1 landed
(source priors 0.85, 0.75, 0.7, 0.65, 0.6, 0.55, then 0.5; each offered-and-reached draft moves its `p[k]` toward 0
or 1 at rate 0.15). A stream at depth d expects `1 + sum_{j<d} prod_{k<=j} p[k]` committed tokens.

In a shared round the allocation starts from every stream's base rows (its next input token, or its prefill chunk)
and adds draft rows greedily, highest landing chance first across streams, keeping the allocation with the best
expected committed tokens per unit of round cost. A round's cost is `price(rows, streams) + draft_price * deepest
draft` (the draft model's passes, one per draft level; 0 for copy drafters). Every 8th round of the engine each stream
probes one deeper than the allocation chose, so that a low estimate (or a draft price measured high once) can
recover; all streams probe in the same round, so a draft model's probe costs one draft pass every 8 rounds, not one
in most rounds.

Prices come from a `PriceTable`: cost of a round by rows, linearly interpolated between known widths (and
extrapolated from the last two beyond them). A fixed table never changes; a timed one folds in measured rounds. For a
target whose weight reads set a round's cost (an MoE whose experts do not fit in the caches), `cost.ExpertPrices`
adds the bytes of the experts a round's streams and drafts are expected to route to.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ACCEPT_PRIORS = (0.85, 0.75, 0.7, 0.65, 0.6, 0.55)
ACCEPT_TAIL = 0.5
ACCEPT_RATE = 0.15
PROBE_EVERY = 8
# A fixed default: a round of n rows costs 1 + n/16 (decode is memory-bound, so extra rows are cheap at first).
DEFAULT_PRICES: tuple[tuple[int, float], ...] = ((1, 1.0), (16, 2.0), (64, 5.0), (256, 17.0))


class Acceptance:
    """One stream's acceptance by depth."""

    __slots__ = ("p",)

    def __init__(self, max_depth: int) -> None:
        self.p = [ACCEPT_PRIORS[k] if k < len(ACCEPT_PRIORS) else ACCEPT_TAIL for k in range(max_depth)]

    def observe(self, n_offered: int, n_accepted: int) -> None:
        """Fold in one round: drafts 0..n_accepted-1 landed, draft n_accepted (if offered) did not."""
        assert 0 <= n_accepted <= n_offered <= len(self.p)
        for k in range(min(n_accepted + 1, n_offered)):
            hit = 1.0 if k < n_accepted else 0.0
            self.p[k] += ACCEPT_RATE * (hit - self.p[k])

    def landing(self, k: int) -> float:
        """Chance that draft k (0-based) lands: the product of p[0..k]."""
        chance = 1.0
        for j in range(k + 1):
            chance *= self.p[j]
        return chance

    def expected(self, depth: int) -> float:
        return 1.0 + sum(self.landing(k) for k in range(depth))


class Prices(Protocol):
    """Cost of a round of `rows` rows over `streams` streams (its base rows and drafts), in seconds or any unit."""

    def price(self, rows: int, streams: int = 1) -> float: ...

    def observe(self, rows: int, seconds: float, streams: int = 1) -> None: ...


class PriceTable:
    """Cost of a round by its row count (whatever its streams). `observe` (timed tables) folds a measured round into
    its width."""

    __slots__ = ("_points", "_rate")

    def __init__(self, points: Sequence[tuple[int, float]], rate: float = 0.2) -> None:
        if not points:
            raise ValueError("a price table needs at least one (rows, cost) point")
        if any(n < 1 or c <= 0 for n, c in points):
            raise ValueError(f"price table points need rows >= 1 and cost > 0: {list(points)}")
        self._points: dict[int, float] = dict(points)
        self._rate = rate

    @property
    def points(self) -> list[tuple[int, float]]:
        return sorted(self._points.items())

    def observe(self, rows: int, seconds: float, streams: int = 1) -> None:
        old = self._points.get(rows)
        self._points[rows] = seconds if old is None else old + self._rate * (seconds - old)

    def price(self, rows: int, streams: int = 1) -> float:
        pts = self.points
        if len(pts) == 1:
            n, c = pts[0]
            return c * rows / n if rows > n else c
        if rows <= pts[0][0]:
            return pts[0][1]
        for (n0, c0), (n1, c1) in itertools.pairwise(pts):
            if rows <= n1:
                return c0 + (c1 - c0) * (rows - n0) / (n1 - n0)
        (n0, c0), (n1, c1) = pts[-2], pts[-1]
        return max(c1, c1 + (c1 - c0) * (rows - n1) / (n1 - n0))


@dataclass(frozen=True, slots=True)
class Seat:
    """One stream's place in a round being planned: its base rows, whether they end in a committed token, the most
    drafts it can hold this round, and its acceptance."""

    base_rows: int
    commits: bool
    max_drafts: int
    acceptance: Acceptance


def probe_round(index: int) -> bool:
    """Whether the engine's round `index` (from 0) is one where every stream probes one draft deeper."""
    return index % PROBE_EVERY == PROBE_EVERY - 1


def allocate(
    seats: Sequence[Seat], prices: Prices, max_rows: int, draft_price: float = 0.0, probe: bool = False
) -> list[int]:
    """Draft rows per seat, maximising expected committed tokens per unit of round cost; in a `probe` round each
    committing seat then holds one more (rows permitting)."""
    depths = [0] * len(seats)
    rows = sum(s.base_rows for s in seats)
    tokens = float(sum(1 for s in seats if s.commits))

    def value(deepest: int) -> float:
        return tokens / (prices.price(max(rows, 1), max(len(seats), 1)) + draft_price * deepest)

    best, best_depths, deepest = value(0), list(depths), 0
    heap = [(-s.acceptance.landing(0), i) for i, s in enumerate(seats) if s.commits and s.max_drafts > 0]
    heapq.heapify(heap)
    while heap and rows < max_rows:
        neg_chance, i = heapq.heappop(heap)
        depths[i] += 1
        rows += 1
        tokens -= neg_chance
        deepest = max(deepest, depths[i])
        if depths[i] < seats[i].max_drafts:
            heapq.heappush(heap, (-seats[i].acceptance.landing(depths[i]), i))
        v = value(deepest)
        if v > best:
            best, best_depths = v, list(depths)
    if probe:
        spare = max_rows - sum(s.base_rows for s in seats) - sum(best_depths)
        for i, s in enumerate(seats):
            if spare > 0 and s.commits and best_depths[i] < s.max_drafts:
                best_depths[i] += 1
                spare -= 1
    return best_depths
