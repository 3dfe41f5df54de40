"""Prometheus metrics of one server: a registry per app (never the global default one), request-side counters the
handlers update, and a collector that reads the engine's and the pager's own counters at scrape time.

Invariants: nothing here is module state; two apps in one process have separate registries; scraping never waits
for a round (it reads counters). A distributed run's scrape gathers every rank's counters in one collective between
two MoE layers' exchanges (docs/distributed.md#metrics): it waits for the layer in flight, and holds the next one
back for that collective only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moelane.server.responses import PagerCost

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0


PagerStats = Callable[[], dict[str, Any]]  # the plain-data form of the store's counters (`PagerStats.to_dict`)
RankCounts = Callable[[], list[Any]]  # a distributed run's counters of each rank (`moelane.dist.counters.RankCounts`)
RANK_METRICS = (
    ("experts", "moelane_rank_experts", "routed experts the rank holds (its share)", GaugeMetricFamily),
    ("resident", "moelane_rank_experts_resident", "experts the rank's memory holds at once", GaugeMetricFamily),
    ("hits", "moelane_rank_expert_hits", "expert accesses found in the rank's memory", CounterMetricFamily),
    ("misses", "moelane_rank_expert_misses", "expert accesses the rank read from disk", CounterMetricFamily),
    ("paged_bytes", "moelane_rank_paged_bytes", "bytes of experts the rank read from disk", CounterMetricFamily),
    ("pairs", "moelane_rank_pairs", "(token, expert) pairs the rank computed", CounterMetricFamily),
    ("compute_s", "moelane_rank_compute_seconds", "seconds the rank computed its pairs", CounterMetricFamily),
    ("exchange_s", "moelane_rank_exchange_seconds", "seconds the rank spent in the exchange's collectives",
     CounterMetricFamily),
    ("user_s", "moelane_rank_cpu_user_seconds", "user CPU seconds of the rank's process", CounterMetricFamily),
    ("system_s", "moelane_rank_cpu_system_seconds", "system CPU seconds of the rank's process", CounterMetricFamily),
)  # fmt: skip


class TokenRate:
    """Completion tokens per second over the last `window` seconds."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        self._events.append((time.monotonic() if now is None else now, n))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()
        return sum(n for _, n in self._events) / self.window


class EngineCollector(Collector):
    """Engine and pager counters, read at scrape time."""

    def __init__(self, engine: Any, rate: TokenRate, pager_stats: PagerStats | None, memory: Any = None,
                 rank_counts: RankCounts | None = None) -> None:  # fmt: skip
        """`memory`: the `MemoryReport` of the model's load (limit, source, minimum, budget), None if unknown.
        `rank_counts`: a distributed run's gathering of each rank's counters (it waits for the exchange of the layer
        in flight, and the other ranks' answer), None in one process."""
        self.engine, self.rate, self.pager_stats, self.memory = engine, rate, pager_stats, memory
        self.rank_counts = rank_counts

    def collect(self) -> Iterator[Any]:
        s = self.engine.stats()
        for name, doc in (
            ("rounds", "engine rounds (batched forward passes)"),
            ("holds", "draft rows placed for verification"),
            ("accepted", "draft rows that became committed tokens"),
            ("committed", "tokens committed to replies"),
            ("prefill_tokens", "prompt tokens fed"),
            ("prefix_hits", "streams that took over the KV cache a finished stream left (prefix caching)"),
            ("prefix_tokens", "prompt tokens taken from kept KV caches instead of fed"),
            ("finished", "streams finished"),
        ):
            yield CounterMetricFamily(f"moelane_engine_{name}", doc, value=float(getattr(s, name, 0)))
        holds = getattr(s, "holds", 0)
        acceptance = s.accepted / holds if holds else 0.0
        yield GaugeMetricFamily("moelane_engine_acceptance", "accepted / held draft rows since start", value=acceptance)
        yield GaugeMetricFamily("moelane_engine_active_streams", "streams in rounds", value=float(s.n_active))
        yield GaugeMetricFamily("moelane_queue_depth", "streams waiting for a slot", value=float(s.n_waiting))
        yield GaugeMetricFamily("moelane_tokens_per_second", f"completion tokens/s over {RATE_WINDOW_S:g}s",
                                value=self.rate.rate())  # fmt: skip
        guard = GaugeMetricFamily(
            "moelane_guard_drafted", "1 if the guard drafts at this stream count, 0 if plain", labels=["streams"]
        )
        for n_streams, mode in sorted(getattr(s, "guard_modes", {}).items()):
            guard.add_metric([str(n_streams)], 1.0 if mode == "drafted" else 0.0)
        yield guard
        yield from self._memory()
        yield from self._pager(float(s.committed))
        yield from self._ranks()

    def _ranks(self) -> Iterator[Any]:
        """Each rank's counters, labelled by rank (a run that has failed: rank 0's only)."""
        if self.rank_counts is None:
            return
        counts = self.rank_counts()
        for field, name, doc, kind in RANK_METRICS:
            family = kind(name, doc, labels=["rank"])
            for c in counts:
                family.add_metric([str(c.rank)], float(getattr(c, field)))
            yield family

    def _memory(self) -> Iterator[Any]:
        """The memory limit found (labelled with its source: a cgroup, free memory or --expert-memory), the minimum
        the model needs and the experts' budget derived from the limit."""
        m = self.memory
        if m is None:
            return
        limit = GaugeMetricFamily("moelane_memory_limit_bytes", "memory limit the process runs under (free memory "
                                  "where none is set), by where it was found: source flag, cgroup_v1, cgroup_v2 or "
                                  "free_memory, and the cgroup that sets it", labels=["source", "group"])  # fmt: skip
        kind, _, group = m.source.partition(" /")
        source = "flag" if kind.startswith("--") else kind.replace(" ", "_")
        limit.add_metric([source, f"/{group}" if group else ""], float(m.limit if m.limit is not None else m.room))
        yield limit
        for name, value, doc in (
            ("minimum", m.minimum, "least memory limit this model runs under"),
            ("expert_budget", m.budget, "bytes of experts held, derived from the limit"),
        ):
            if value is not None:
                yield GaugeMetricFamily(f"moelane_memory_{name}_bytes", doc, value=float(value))

    def _pager(self, committed: float) -> Iterator[Any]:
        """Store counters: accesses by phase, reads by storage level and precision tier, disk bytes by phase and per
        committed token (empty without a store)."""
        d = self.pager_stats() if self.pager_stats else {}
        by_phase = d.get("by_phase", {})
        for key, doc in (("hits", "expert accesses found resident"), ("misses", "expert accesses that had to be read"),
                         ("prefetch_hits", "accesses found resident thanks to a prefetch"),
                         ("stall_s", "seconds passes waited for expert reads")):  # fmt: skip
            name = "moelane_pager_stall_seconds" if key == "stall_s" else f"moelane_pager_{key}"
            family = CounterMetricFamily(name, doc, labels=["phase"])
            for phase, counts in sorted(by_phase.items()):
                family.add_metric([phase], float(counts.get(key, 0)))
            yield family
        for key, doc in (("bytes_read", "bytes of experts read"), ("experts_read", "experts read")):
            family = CounterMetricFamily(f"moelane_pager_{key}", f"{doc}, by storage level and precision",
                                         labels=["level", "precision"])  # fmt: skip
            for where, n in sorted(d.get(key, {}).items()):
                level, _, precision = where.partition("/")
                family.add_metric([level, precision], float(n))
            yield family
        yield CounterMetricFamily("moelane_pager_evictions", "experts evicted", value=float(d.get("evictions", 0)))
        family = CounterMetricFamily("moelane_pager_disk_bytes", "bytes of experts read from disk, by the phase of "
                                     "the pass that asked", labels=["phase"])  # fmt: skip
        for phase, n in sorted(d.get("disk_bytes_by_phase", {}).items()):
            family.add_metric([phase], float(n))
        yield family
        disk = sum(d.get("disk_bytes_by_phase", {}).values())
        yield GaugeMetricFamily("moelane_pager_disk_bytes_per_token", "bytes of experts read from disk per token "
                                "committed, since start", value=disk / committed if committed else 0.0)  # fmt: skip


class ServerMetrics:
    """The app's registry and the request-side metrics its handlers update."""

    def __init__(self, engine: Any, pager_stats: PagerStats | None = None, memory: Any = None,
                 rank_counts: RankCounts | None = None) -> None:  # fmt: skip
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rate = TokenRate()
        self.requests = Counter("moelane_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)  # fmt: skip
        self.prompt_tokens = Counter("moelane_prompt_tokens", "prompt tokens of served requests", registry=r)
        self.completion_tokens = Counter("moelane_completion_tokens", "completion tokens sent", registry=r)
        self.rejected = Counter("moelane_rejected", "requests refused with 429 (queue full)", registry=r)
        self.cancelled = Counter("moelane_cancelled", "streams cancelled by a client disconnect", registry=r)
        self.in_flight = Gauge("moelane_requests_in_flight", "admitted generation requests", registry=r)
        self.ttft = Histogram("moelane_time_to_first_token_seconds", "submit to first committed token",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("moelane_inter_token_latency_seconds", "mean gap between tokens, per choice",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.latency = Histogram("moelane_request_seconds", "generation request wall time",
                                 buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.req_experts = Counter("moelane_request_pager_experts_fetched", "experts fetched for requests", registry=r)
        self.req_bytes = Counter("moelane_request_pager_bytes", "bytes fetched for requests", registry=r)
        self.req_stall = Counter("moelane_request_pager_stall_seconds", "stall charged to requests", registry=r)
        r.register(EngineCollector(engine, self.rate, pager_stats, memory, rank_counts))

    def observe_request(
        self, n_prompt: int, started: float, choices: list[tuple[int, float | None]], cost: PagerCost
    ) -> None:
        """One finished request: its prompt tokens (each prompt once), and per choice (tokens, first token's
        time). Latency and time to first token are the request's; the token gap is each choice's."""
        now = time.monotonic()
        self.prompt_tokens.inc(n_prompt)
        self.completion_tokens.inc(sum(n for n, _ in choices))
        self.latency.observe(now - started)
        firsts = [first for _, first in choices if first is not None]
        if firsts:
            self.ttft.observe(min(firsts) - started)
        for n_tokens, first in choices:
            if first is not None and n_tokens > 1:
                self.itl.observe((now - first) / (n_tokens - 1))
        self.req_experts.inc(cost.experts_fetched)
        self.req_bytes.inc(cost.bytes_fetched)
        self.req_stall.inc(cost.stall_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
