"""`SpreadExperts`: rank 0's expert provider, whose experts live on every rank (the exchange of `moelane.dist`).

Invariant: every exchange rank 0 starts is finished on every rank, whatever fails in between (rank 0's own share
raising included), so the ranks stay in step; the one exception is a rank that has failed, after which no exchange is
started again (`fault`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moelane.dist.counters import RankCounts, Tally, counts_of, format_rank
from moelane.dist.errors import RankError, RankFailure
from moelane.dist.placement import Placement
from moelane.dist.ranks import Ranks
from moelane.dist.wire import LAYER, STATS, STOP, Request, header, pack_request, reply_bytes, unpack_reply
from moelane.errors import MoelaneError
from moelane.model.experts import Act, PairBias, pair_outputs
from moelane.model.footprint import expert_bytes
from moelane.model.provider import ExpertProvider, TierPool
from moelane.pager.live.build import format_stats

log = logging.getLogger(__name__)
NO_POOLS = "the experts of a distributed run are spread over its ranks: they are computed through pair_outputs"


@dataclass(slots=True)
class ExchangeStats:
    """Rank 0's counts of MoE layer calls, those that exchanged with other ranks, and what that took."""

    calls: int = 0
    exchanges: int = 0
    local_pairs: int = 0
    remote_pairs: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    exchange_s: float = 0.0  # rank 0's time in the exchange's collectives (its own share computes in between)


class SpreadExperts:
    """The experts of `placement` over `ranks`; rank 0's share in `local` (local ids: `Placement.local_ids`)."""

    def __init__(self, ranks: Ranks, placement: Placement, local: ExpertProvider, dims: tuple[int, int],
                 dtype: torch.dtype, limits: list[int | None]) -> None:  # fmt: skip
        self.ranks, self.placement, self.local, self.dtype = ranks, placement, local, dtype
        self.hidden, self.width = dims
        self.owners = {layer: placement.owner_ids(layer) for layer in placement.owners}  # each [E]
        self.local_ids = {layer: placement.local_ids(layer) for layer in placement.owners}  # each [E]
        self.limits = limits  # each rank's most rows a pass (None: no limit)
        self.stats = ExchangeStats()
        self.tally = Tally()  # rank 0's own share's computation
        self.n_held = [sum(len(placement.experts(layer, r)) for layer in placement.owners) for r in range(ranks.world)]
        self.fault: RankFailure | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---- the provider protocol: the experts are not in pools here -------------------------------------------------

    def pools(self, layer: int) -> tuple[TierPool, ...]:
        raise MoelaneError(NO_POOLS)

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise MoelaneError(NO_POOLS)

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        raise MoelaneError(NO_POOLS)

    def expert_bytes(self, layer: int) -> float:
        """Bytes of one expert of `layer` (`model.footprint`): as rank 0 holds its own share."""
        return expert_bytes(self.local, layer)

    def max_rows(self, top_k: int) -> int:
        """The most rows a pass may route through one layer: the smallest of the ranks' limits."""
        return min([limit for limit in self.limits if limit is not None], default=1 << 30)

    # ---- one MoE layer ------------------------------------------------------------------------------------------

    def pair_outputs(self, rows: torch.Tensor, rows_of: torch.Tensor, layer: int, ids: torch.Tensor, act: Act,
                     bias: PairBias | None) -> torch.Tensor:  # fmt: skip
        """Each pair's expert output [P, H] in pair order (`experts.pair_outputs`'s contract), each computed on the
        rank that holds its expert. ids [T, K]; rows [R, H]; rows_of [P]."""
        with self._lock:
            if self.fault is not None:
                raise self.fault
            if self._closed:
                raise MoelaneError("this distributed model was closed; load it again to use it")
            flat = ids.reshape(-1)
            owner = self.owners[layer][flat]
            picks = [(owner == r).nonzero().reshape(-1) for r in range(self.ranks.world)]
            self.stats.calls += 1
            self.stats.local_pairs += picks[0].numel()
            if picks[0].numel() == flat.numel():  # (every pair rank 0's own: nothing to exchange)
                return self._own(rows, rows_of, layer, flat, ids.shape[0], act, bias)
            y = rows.new_empty(flat.numel(), self.hidden)
            self._exchange(y, picks, rows, rows_of, layer, flat, ids.shape[0], act, bias)
            return y

    def _own(self, rows: torch.Tensor, rows_of: torch.Tensor, layer: int, flat: torch.Tensor, n_tokens: int,
             act: Act, bias: PairBias | None) -> torch.Tensor:  # fmt: skip
        local_ids, start = self.local_ids[layer][flat], time.perf_counter()
        with phase_of(self.local, n_tokens):
            y = pair_outputs(rows, rows_of, layer, local_ids, self.local, act, bias)
        self.tally.computed(local_ids, start)
        return y

    def _exchange(self, y: torch.Tensor, picks: list[torch.Tensor], rows: torch.Tensor, rows_of: torch.Tensor,
                  layer: int, flat: torch.Tensor, n_tokens: int, act: Act, bias: PairBias | None) -> None:  # fmt: skip
        world, data = self.ranks.world, self.ranks.data
        requests = [self._request(layer, picks[r], rows, rows_of, flat, bias) for r in range(1, world)]
        counts = [(0, 0)] + [(int(q.rows.shape[0]), int(q.ids.numel())) for q in requests]
        blobs = [pack_request(q) for q in requests]
        sizes = [0] + [int(b.numel()) for b in blobs]
        back = [0] + [reply_bytes(n_pairs, self.hidden, self.dtype) for _, n_pairs in counts[1:]]
        head = header(LAYER, world, layer, n_tokens, bias is not None, counts)
        nothing = torch.empty(0, dtype=torch.uint8)
        start = time.perf_counter()
        try:
            dist.broadcast(head, 0, group=self.ranks.control)
            sent = dist.all_to_all_single(nothing, torch.cat(blobs), [0] * world, sizes, group=data, async_op=True)
        except RuntimeError as e:
            raise self._failed(e) from None
        spent = time.perf_counter() - start
        failure: Exception | None = None
        own = picks[0]
        try:
            if own.numel():
                y[own] = self._own(rows, rows_of[own], layer, flat[own], n_tokens, act,
                                   None if bias is None else bias.take(own))  # fmt: skip
        except Exception as e:  # (raised once the exchange is over: the ranks stay in step)
            failure = e
        start = time.perf_counter()
        try:
            assert sent is not None
            sent.wait()
            replies = torch.empty(sum(back), dtype=torch.uint8)
            dist.all_to_all_single(replies, nothing, back, [0] * world, group=data)
        except RuntimeError as e:
            raise self._failed(e) from None
        s = self.stats
        s.exchanges, s.remote_pairs = s.exchanges + 1, s.remote_pairs + flat.numel() - own.numel()
        s.bytes_out, s.bytes_in = s.bytes_out + sum(sizes), s.bytes_in + sum(back)
        s.exchange_s += spent + time.perf_counter() - start
        if failure is not None:
            raise failure
        self._place(y, picks, replies, back, layer)

    def _request(self, layer: int, pick: torch.Tensor, rows: torch.Tensor, rows_of: torch.Tensor, flat: torch.Tensor,
                 bias: PairBias | None) -> Request:  # fmt: skip
        """What a rank computes (its pairs, `pick`): their rows (each once), each pair's row among them and its
        expert's local id."""
        used, row_of = torch.unique(rows_of[pick], return_inverse=True)
        ids = self.local_ids[layer][flat[pick]]
        return Request(rows[used], row_of, ids, None if bias is None else bias.take(pick))

    def _place(self, y: torch.Tensor, picks: list[torch.Tensor], replies: torch.Tensor, back: list[int],
               layer: int) -> None:  # fmt: skip
        errors, at = [], back[0]
        for rank in range(1, self.ranks.world):
            out = unpack_reply(replies[at : at + back[rank]], picks[rank].numel(), self.hidden, self.dtype)
            at += back[rank]
            if isinstance(out, str):
                errors.append(f"rank {rank}: {out}")
            elif picks[rank].numel():
                y[picks[rank]] = out
        if errors:
            raise RankError(f"MoE layer {layer} could not be computed: {'; '.join(errors)}")

    def _failed(self, e: RuntimeError) -> RankFailure:
        """Mark the run failed, for good: its ranks are out of step, or gone."""
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        line = re.sub(r"^\[[^\]]*\]\s*", "", line)  # (gloo's source location)
        self.fault = RankFailure(f"a rank of this distributed run died or did not answer within the "
                                 f"{self.ranks.timeout_s:g} s of --dist-timeout: {line}")  # fmt: skip
        log.error("%s; every request fails from now on (restart the run)", self.fault)
        return self.fault

    # ---- the end --------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the other ranks to stop (unless one has failed), and close rank 0's own provider."""
        with self._lock:
            if not self._closed and self.fault is None:
                try:
                    dist.broadcast(header(STOP, self.ranks.world), 0, group=self.ranks.control)
                except RuntimeError as e:
                    log.warning("could not tell the other ranks to stop: %s", e)
            self._closed = True
        close = getattr(self.local, "close", None)
        if close is not None:
            close()

    def rank_counts(self) -> list[RankCounts]:
        """Every rank's counters (`counters.py`), rank 0's first: the others' gathered in one collective on the data
        group (so a rank that does not answer fails it within the timeout, as a pass). Only rank 0's once the run has
        failed or closed."""
        with self._lock:
            s = self.stats
            ours = counts_of(0, self.local, self.n_held[0], Tally(self.tally.pairs, self.tally.accesses,
                                                                  self.tally.compute_s, s.exchange_s))  # fmt: skip
            if self.fault is not None or self._closed:
                return [ours]
            theirs: list[RankCounts | None] = [None] * self.ranks.world
            try:
                dist.broadcast(header(STATS, self.ranks.world), 0, group=self.ranks.control)
                dist.gather_object(None, theirs, 0, group=self.ranks.data)
            except RuntimeError as e:
                raise self._failed(e) from None
            return [ours] + [c for c in theirs[1:] if c is not None]

    def describe(self) -> str:
        """Lines for `moelane run --stats`: the spread, the exchange's counts, each rank's counters, rank 0's own
        store."""
        s = self.stats
        ranks = "\n".join(format_rank(c) for c in self.rank_counts())
        return (f"{self.placement.describe()}\n"
                f"  MoE layer calls {s.calls}, {s.exchanges} exchanged; pairs {s.local_pairs} on rank 0, "
                f"{s.remote_pairs} elsewhere; {s.bytes_out} bytes out, {s.bytes_in} in; {s.exchange_s:.3f} s in "
                f"the exchange\n{ranks}\nrank 0's share: {format_stats(self.local)}")  # fmt: skip


def phase_of(provider: Any, n_tokens: int) -> contextlib.AbstractContextManager[None]:
    """A store labels a layer call by its pass (one token: "decode"), as one process's [T, K] ids would tell it."""
    phase = getattr(provider, "phase", None)
    return phase("decode" if n_tokens == 1 else "prefill") if phase is not None else contextlib.nullcontext()
