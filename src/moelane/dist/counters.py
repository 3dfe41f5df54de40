"""Each rank's counters, as plain data rank 0 gathers on request (`SpreadExperts.rank_counts`): the experts it holds,
its accesses to them, the bytes it paged in, the pairs it computed, its time in the exchange, its process's CPU time.

A rank counts as it goes (`Tally`, on its own thread of exchanges) and reads its store's counters only when asked;
an access is one (pass, layer, distinct expert), as an expert store counts them, so a rank whose experts are all
resident hits on every access.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from moelane.pager.live.build import disk_bytes
from moelane.pager.live.store import ExpertStore


@dataclass(slots=True)
class Tally:
    """What a rank counts itself in its part of the exchanges."""

    pairs: int = 0
    accesses: int = 0
    compute_s: float = 0.0  # computing its own pairs
    exchange_s: float = 0.0  # in the exchange's collectives (for a worker: from receiving its rows to sending back)

    def computed(self, local_ids: torch.Tensor, start: float) -> None:
        """One layer call's pairs (their experts' local ids), computed since `start` (perf_counter)."""
        self.compute_s += time.perf_counter() - start
        self.pairs += local_ids.numel()
        self.accesses += int(torch.unique(local_ids).numel())


@dataclass(frozen=True, slots=True)
class RankCounts:
    """One rank's counters. `resident`: experts its memory holds at once (all of them where none is paged)."""

    rank: int
    experts: int
    resident: int
    hits: int
    misses: int
    paged_bytes: int
    pairs: int
    compute_s: float
    exchange_s: float
    user_s: float  # the rank's process's CPU time so far (os.times), all its threads
    system_s: float


def counts_of(rank: int, provider: object, n_experts: int, tally: Tally) -> RankCounts:
    """`rank`'s counters: its tally, and its store's accesses and disk reads where it pages (`n_experts`: its share)."""
    hits, misses, resident = tally.accesses, 0, n_experts
    if isinstance(provider, ExpertStore):
        with provider._cond:
            totals = provider.stats.totals()
        hits, misses, resident = totals.hits + totals.prefetch_hits, totals.misses, min(provider.n_slots, n_experts)
    cpu = os.times()
    return RankCounts(rank, n_experts, resident, hits, misses, disk_bytes(provider), tally.pairs, tally.compute_s,
                      tally.exchange_s, cpu.user, cpu.system)  # fmt: skip


def format_rank(c: RankCounts) -> str:
    """One line of `moelane run --stats` for a rank."""
    paged = f"{c.paged_bytes / 2**20:.1f} MiB paged in" if c.resident < c.experts else "none paged (all resident)"
    return (f"  rank {c.rank}: {c.experts} experts, {c.resident} in memory at once; {c.hits} hits, {c.misses} "
            f"misses, {paged}; {c.pairs} pairs in {c.compute_s:.3f} s, {c.exchange_s:.3f} s in the "
            f"exchange; CPU {c.user_s:.1f} s user, {c.system_s:.1f} s system")  # fmt: skip
