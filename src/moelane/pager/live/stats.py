"""Counters of the live expert store: what hit, what missed, what was read from where, and how long compute waited.

`PagerStats` is one set of counters; the store keeps one overall and one per tracked request (`ExpertStore.track`),
and updates them under its lock. Accesses (hits, misses, prefetch hits, stall seconds) are counted by phase;
bytes read are counted by storage level ("host" RAM copies, "disk" shards or tier files) and precision tier, and
disk bytes by the phase of the pass they were issued in (prefetches: the phase of the pass begun last), so that
disk bytes per decode pass are a one-row decode's disk bytes per token;
prefetches by the source that issued them ("lookahead", "cooc", "warm"). `to_dict` is the plain-data form the server
exposes; `moelane.pager.live.build.format_stats` turns them into the text `moelane run --stats` prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from moelane.pager.live.memory import format_bytes


@dataclass(slots=True)
class PhaseCounts:
    """Expert accesses of one phase. An access is one (pass, layer, distinct expert)."""

    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0  # resident (or in flight) only because a prefetch brought it
    stall_s: float = 0.0  # time `slots` spent waiting for reads
    layer_calls: int = 0

    @property
    def accesses(self) -> int:
        return self.hits + self.misses + self.prefetch_hits


@dataclass(slots=True)
class PrefetchCounts:
    """One prefetch source: experts it asked for, loads it started, and how those ended."""

    predicted: int = 0  # experts named by the predictor
    correct: int = 0  # ... that the routing then used (recall numerator, measured where the source scores itself)
    routed: int = 0  # experts routed where the predictor was scored (recall denominator)
    issued: int = 0  # loads started (the rest were already resident or found no victim)
    used: int = 0  # loads a later pass used
    wasted: int = 0  # loads evicted before any use
    late: int = 0  # loads a pass wanted before they started (it ran them as its own misses)
    dropped: int = 0  # loads still queued when the pass they were for had gone by without them: never read


@dataclass(slots=True)
class PagerStats:
    by_phase: dict[str, PhaseCounts] = field(default_factory=dict)
    bytes_read: dict[tuple[str, str], int] = field(default_factory=dict)  # (level, tier name) -> bytes
    reads: dict[tuple[str, str], int] = field(default_factory=dict)  # (level, tier name) -> experts
    read_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (level, tier name) -> seconds loading
    prefetch: dict[str, PrefetchCounts] = field(default_factory=dict)
    evictions: int = 0
    passes: dict[str, int] = field(default_factory=dict)  # phase -> passes begun
    disk_by_phase: dict[str, int] = field(default_factory=dict)  # phase of the pass a disk read was issued in -> bytes

    def phase(self, name: str) -> PhaseCounts:
        if name not in self.by_phase:
            self.by_phase[name] = PhaseCounts()
        return self.by_phase[name]

    def source(self, name: str) -> PrefetchCounts:
        if name not in self.prefetch:
            self.prefetch[name] = PrefetchCounts()
        return self.prefetch[name]

    def add_read(self, level: str, tier: str, n_bytes: int, seconds: float = 0.0) -> None:
        """One expert loaded: its stored bytes, and the seconds the load took (read, decode, check) on its thread."""
        self.bytes_read[(level, tier)] = self.bytes_read.get((level, tier), 0) + n_bytes
        self.reads[(level, tier)] = self.reads.get((level, tier), 0) + 1
        self.read_s[(level, tier)] = self.read_s.get((level, tier), 0.0) + seconds

    def add_disk(self, phase: str, n_bytes: int) -> None:
        self.disk_by_phase[phase] = self.disk_by_phase.get(phase, 0) + n_bytes

    def disk_per_pass(self, phase: str = "decode") -> float | None:
        """Disk bytes read per pass of `phase` (one-row decode: per token), None before any such pass."""
        n = self.passes.get(phase, 0)
        return self.disk_by_phase.get(phase, 0) / n if n else None

    def load_speed(self, level: str) -> float | None:
        """Bytes per second of this level's loads, one thread's view (None before any timed load)."""
        n = sum(b for (lv, _), b in self.bytes_read.items() if lv == level)
        seconds = sum(t for (lv, _), t in self.read_s.items() if lv == level)
        return n / seconds if seconds > 0 else None

    def totals(self) -> PhaseCounts:
        out = PhaseCounts()
        for c in self.by_phase.values():
            out.hits += c.hits
            out.misses += c.misses
            out.prefetch_hits += c.prefetch_hits
            out.stall_s += c.stall_s
            out.layer_calls += c.layer_calls
        return out

    def to_dict(self) -> dict[str, Any]:
        def counts(c: PhaseCounts) -> dict[str, Any]:
            hit_rate = (c.hits + c.prefetch_hits) / c.accesses if c.accesses else 0.0
            return {"hits": c.hits, "misses": c.misses, "prefetch_hits": c.prefetch_hits, "hit_rate": hit_rate,
                    "stall_s": c.stall_s, "layer_calls": c.layer_calls}  # fmt: skip

        return {
            "total": counts(self.totals()),
            "by_phase": {name: counts(c) for name, c in sorted(self.by_phase.items())},
            "bytes_read": {f"{level}/{tier}": n for (level, tier), n in sorted(self.bytes_read.items())},
            "experts_read": {f"{level}/{tier}": n for (level, tier), n in sorted(self.reads.items())},
            "read_s": {f"{level}/{tier}": t for (level, tier), t in sorted(self.read_s.items())},
            "prefetch": {name: asdict(p) for name, p in sorted(self.prefetch.items())},
            "evictions": self.evictions,
            "passes": dict(sorted(self.passes.items())),
            "disk_bytes_by_phase": dict(sorted(self.disk_by_phase.items())),
        }


def format_counts(stats: PagerStats, header: str) -> list[str]:
    lines = [header]
    for name, c in [*sorted(stats.by_phase.items()), ("all", stats.totals())]:
        rate = (c.hits + c.prefetch_hits) / c.accesses if c.accesses else 0.0
        lines.append(
            f"  {name:<8} hits {c.hits:>8}  misses {c.misses:>8}  prefetch hits {c.prefetch_hits:>7}  "
            f"hit rate {rate:6.1%}  stall {c.stall_s:8.3f} s"
        )
    for (level, tier), n in sorted(stats.bytes_read.items()):
        seconds = stats.read_s.get((level, tier), 0.0)
        speed = f", {n / seconds / 1e6:,.0f} MB/s a thread" if seconds > 0 else ""
        lines.append(f"  read {level:<4} {tier:<6} {format_bytes(n):>12}  ({stats.reads[(level, tier)]} experts"
                     f"{speed})")  # fmt: skip
    for name, p in sorted(stats.prefetch.items()):
        recall = f"recall {p.correct / p.routed:6.1%}  " if p.routed else ""
        lines.append(f"  prefetch {name:<9} {recall}issued {p.issued:>7}  used {p.used:>7}  wasted {p.wasted:>7}  "
                     f"late {p.late:>5}  dropped {p.dropped:>5}")  # fmt: skip
    lines.append(f"  evictions {stats.evictions}")
    for phase, n in sorted(stats.passes.items()):
        disk = stats.disk_by_phase.get(phase, 0)
        lines.append(f"  disk {phase:<8} {format_bytes(disk):>12} read in {n} passes ({format_bytes(disk / n)} a pass)")
    return lines
