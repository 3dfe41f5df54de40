"""What each request cost the expert pager, for the `moelane` extension field and the metrics.

The lanes engine runs many streams in one forward pass, so a pass's pager work (experts read, bytes, time waiting
for reads) belongs to all of them together. `PagerLedger` is a routing observer: after each pass it takes the store's
counters, and charges what changed since the previous pass to the streams in that pass in proportion to their rows.
The shares of one pass add up to that pass's work, so the requests' costs add up to the store's totals. It also
adds each pass's accesses (found resident, or not) to the pass's phase as the model labels it from its rows
(`RoutingRecord.phase`: "decode" when every row is one token, whatever the streams; "prefill", "mixed"), which the
store itself cannot tell apart (it calls a pass of several rows prefill): the dashboard's decode and prefill hit rates.

Invariants: reads the store's counters only (never its lock or slots); keeps at most `max_entries` streams' costs
(the oldest are dropped); without an expert store every cost is zero.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
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
        self._phases: dict[str, list[float]] = {}  # the record's phase -> found resident, accesses, stall seconds

    def observe(self, record: Any) -> None:
        now = snapshot(self.store.stats)
        delta = [a - b for a, b in zip(now, self._last, strict=True)]
        self._last = now
        rows = Counter(record.stream_ids)
        n_rows = sum(rows.values())
        experts, n_bytes, stall, found, accesses = delta
        with self._lock:
            phase = self._phases.setdefault(record.phase, [0.0, 0.0, 0.0])
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

    def phases(self) -> dict[str, dict[str, float]]:
        """Accesses by the passes' phases since start: {phase: {found, accesses, stall_s}}."""
        with self._lock:
            return {name: {"found": f, "accesses": n, "stall_s": s} for name, (f, n, s) in self._phases.items()}

    def cost_of(self, stream: Any) -> PagerCost:
        with self._lock:
            experts, n_bytes, stall = self._bills.get(stream.id, (0.0, 0.0, 0.0))
        return PagerCost(experts_fetched=round(experts), bytes_fetched=round(n_bytes), stall_ms=stall * 1000)


def pager_hooks(lm: Any) -> tuple[Callable[[Any], PagerCost] | None, Callable[[], dict[str, Any]] | None]:
    """(cost_of, pager_stats) for an LM whose provider is an expert store (attaching a ledger), else (None, None).
    `pager_stats()` is the store's `PagerStats.to_dict()` with the ledger's `phases()` as "pass_phases"."""
    store = lm.provider
    if not hasattr(store, "stats") or not hasattr(store.stats, "bytes_read"):
        return None, None
    ledger = PagerLedger(store)
    lm.observers.append(ledger)
    return ledger.cost_of, lambda: {**store.stats.to_dict(), "pass_phases": ledger.phases()}
