"""What each request cost the expert pager, for the `moelane` extension field and the metrics.

The lanes engine runs many streams in one forward pass, so a pass's pager work (experts read, bytes, time waiting
for reads) belongs to all of them together. `PagerLedger` is a routing observer: after each pass it takes the store's
counters, and charges what changed since the previous pass to the streams in that pass in proportion to their rows.
The shares of one pass add up to that pass's work, so the requests' costs add up to the store's totals.

It also adds each pass's accesses (found resident, or not) and stall to its phase, for the dashboard: "prefill" if a
stream in it was still feeding its prompt, else "decode" (generated rows, drafts included). Neither the store (which
calls a pass of several rows prefill) nor the model's label (which calls a stream's drafts prefill) can tell, so the
server `track`s each stream it submits: its prompt rows still to feed (less those a kept cache gave it) are counted
down by its rows in each pass.

Invariants: reads the store's counters only (never its lock or slots); keeps at most `max_entries` streams' costs
and prompt countdowns (the oldest are dropped); without an expert store every cost is zero.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moelane.server.responses import PagerCost

Snapshot = tuple[int, int, float, int, int]  # experts read, bytes read, stall seconds, found resident, accesses


def snapshot(stats: Any) -> Snapshot:
    """Totals of a `moelane.pager.live.stats.PagerStats` (copied with C-level dict copies, safe against its writers)."""
    reads, bytes_read = dict(stats.reads), dict(stats.bytes_read)
    stall, found, accesses = 0.0, 0, 0
    for c in list(stats.by_phase.values()):
        stall += c.stall_s
        found += c.hits + c.prefetch_hits
        accesses += c.hits + c.prefetch_hits + c.misses
    return sum(reads.values()), sum(bytes_read.values()), stall, found, accesses


class PagerLedger:
    """A routing observer charging each pass's pager work to its streams; `cost_of(stream)` reads a stream's bill."""

    def __init__(self, store: Any, max_entries: int = 4096) -> None:
        self.store, self.max_entries = store, max_entries
        self._lock = threading.Lock()
        self._last = snapshot(store.stats)
        self._bills: OrderedDict[int, list[float]] = OrderedDict()
        self._phases: dict[str, list[float]] = {}  # phase -> found resident, accesses, stall seconds
        self._prompts: OrderedDict[int, Any] = OrderedDict()  # stream id -> the stream, until its first pass
        self._left: dict[int, int] = {}  # stream id -> prompt rows it still has to feed

    def track(self, stream: Any) -> None:
        """A stream just submitted: the passes it feeds prompt rows in count as prefill. (One whose first token
        is already committed, the engine thread having run its prompt first, is left out.)"""
        if stream.token_ids:
            return
        with self._lock:
            self._prompts[stream.id] = stream
            while len(self._prompts) > self.max_entries:
                self._prompts.popitem(last=False)

    def observe(self, record: Any) -> None:
        now = snapshot(self.store.stats)
        delta = [a - b for a, b in zip(now, self._last, strict=True)]
        self._last = now
        rows = Counter(record.stream_ids)
        n_rows = sum(rows.values())
        experts, n_bytes, stall, found, accesses = delta
        with self._lock:
            phase = self._phases.setdefault("prefill" if self._fed_prompt(rows) else "decode", [0.0, 0.0, 0.0])
            for i, d in enumerate((found, accesses, stall)):
                phase[i] += d
            if not n_rows or not (experts or n_bytes or stall):
                return
            for stream_id, n in rows.items():
                bill = self._bills.setdefault(stream_id, [0.0, 0.0, 0.0])
                for i, d in enumerate((experts, n_bytes, stall)):
                    bill[i] += d * n / n_rows
            while len(self._bills) > self.max_entries:
                self._bills.popitem(last=False)

    def _fed_prompt(self, rows: Counter[int]) -> bool:
        """Whether a stream of a pass with these rows per stream fed prompt rows; counts them down (under the lock)."""
        prompt = False
        for stream_id, n in rows.items():
            left = self._left.pop(stream_id, None)
            if left is None and (stream := self._prompts.pop(stream_id, None)) is not None:
                left = len(stream.prompt_ids) - stream.n_cached  # (set when it was admitted, before this pass)
            if left is not None and left > 0:
                prompt = True
                if left > n and len(self._left) < self.max_entries:
                    self._left[stream_id] = left - n
        return prompt

    def phases(self) -> dict[str, dict[str, float]]:
        """Accesses by the passes' phases since start: {phase: {found, accesses, stall_s}}."""
        with self._lock:
            return {name: {"found": f, "accesses": n, "stall_s": s} for name, (f, n, s) in self._phases.items()}

    def cost_of(self, stream: Any) -> PagerCost:
        with self._lock:
            experts, n_bytes, stall = self._bills.get(stream.id, (0.0, 0.0, 0.0))
        return PagerCost(experts_fetched=round(experts), bytes_fetched=round(n_bytes), stall_ms=stall * 1000)


@dataclass(frozen=True, slots=True)
class PagerHooks:
    """What the app needs of a ledger: a request's cost, the store's counters (`PagerStats.to_dict()` with the
    ledger's `phases()` as "pass_phases"), and `track(stream)` for each stream it submits."""

    cost_of: Callable[[Any], PagerCost]
    stats: Callable[[], dict[str, Any]]
    track: Callable[[Any], None]


def pager_hooks(lm: Any) -> PagerHooks | None:
    """The hooks of a ledger attached to an LM whose provider is an expert store, else None."""
    store = lm.provider
    if not hasattr(store, "stats") or not hasattr(store.stats, "bytes_read"):
        return None
    ledger = PagerLedger(store)
    lm.observers.append(ledger)
    return PagerHooks(ledger.cost_of, lambda: {**store.stats.to_dict(), "pass_phases": ledger.phases()}, ledger.track)
