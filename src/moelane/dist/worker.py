"""A rank other than 0: compute this rank's pairs of each exchange rank 0 starts, until rank 0 says stop.

    head  <- rank 0 (control)          # which layer, how many rows and pairs each rank gets (or STATS: this rank's
                                       # counters -> rank 0, one gather on the data group; or STOP)
    rows  <- rank 0 (data)             # this rank's pairs' rows and local expert ids
    y      = pair_outputs(...)         # as one process would compute these pairs
    y     -> rank 0 (data)             # or the error that stopped it: the ranks stay in step either way

A rank needs no dense weight: its experts' handles, and each MoE layer's activation (`launch.layer_acts`).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from moelane.dist.counters import Tally, counts_of
from moelane.dist.errors import RankFailure
from moelane.dist.ranks import Ranks
from moelane.dist.spread import phase_of
from moelane.dist.wire import (
    HEAD,
    STATS,
    STOP,
    header,
    pack_failure,
    pack_reply,
    reply_bytes,
    request_bytes,
    unpack_request,
)
from moelane.errors import MoelaneError
from moelane.model.experts import Act, pair_outputs
from moelane.model.provider import ExpertProvider

log = logging.getLogger(__name__)


def serve_layers(ranks: Ranks, provider: ExpertProvider, acts: dict[int, Act], dims: tuple[int, int],
                 dtype: torch.dtype, n_experts: int) -> None:  # fmt: skip
    """Answer rank 0's exchanges with this rank's experts (`provider`, local ids; `n_experts` of them over every
    layer) until it sends STOP. `acts`: each MoE layer's activation; dims: (H, I). RankFailure when rank 0 goes
    away."""
    head = header(STOP, ranks.world)
    tally = Tally()
    while True:
        try:
            dist.broadcast(head, 0, group=ranks.control)
        except RuntimeError as e:
            raise RankFailure(f"rank 0 went away: {e}") from None
        op, layer, n_tokens, has_bias = head[:HEAD].tolist()
        if op == STOP:
            return
        try:
            if op == STATS:
                dist.gather_object(counts_of(ranks.rank, provider, n_experts, tally), None, 0, group=ranks.data)
                continue
            n_rows, n_pairs = head[HEAD + 2 * ranks.rank : HEAD + 2 * ranks.rank + 2].tolist()
            what = (layer, n_tokens, n_rows, n_pairs, bool(has_bias))
            exchange(ranks, provider, acts, dims, dtype, what, tally)
        except RuntimeError as e:
            raise RankFailure(f"rank 0 went away or fell out of step: {e}") from None


def exchange(ranks: Ranks, provider: ExpertProvider, acts: dict[int, Act], dims: tuple[int, int], dtype: torch.dtype,
             what: tuple[int, int, int, int, bool], tally: Tally) -> None:  # fmt: skip
    """This rank's part of one exchange: its rows in, its pairs' outputs (or error) back."""
    _, _, n_rows, n_pairs, has_bias = what
    world, nothing = ranks.world, torch.empty(0, dtype=torch.uint8)
    blob = torch.empty(request_bytes(n_rows, n_pairs, *dims, dtype, has_bias), dtype=torch.uint8)
    to_rank0 = [0] * world  # (a worker sends to, and hears from, rank 0 only)
    start = time.perf_counter()
    dist.all_to_all_single(blob, nothing, [blob.numel(), *to_rank0[1:]], to_rank0, group=ranks.data)
    reply = answer(blob, provider, acts, dims, dtype, what, tally)
    dist.all_to_all_single(nothing, reply, to_rank0, [reply.numel(), *to_rank0[1:]], group=ranks.data)
    tally.exchange_s += time.perf_counter() - start


def answer(blob: torch.Tensor, provider: ExpertProvider, acts: dict[int, Act], dims: tuple[int, int],
           dtype: torch.dtype, what: tuple[int, int, int, int, bool], tally: Tally) -> torch.Tensor:  # fmt: skip
    """The reply to one request: its pairs' outputs, or the error that stopped them."""
    layer, n_tokens, n_rows, n_pairs, has_bias = what
    hidden, width = dims
    try:
        request = unpack_request(blob, n_rows, n_pairs, hidden, width, dtype, has_bias)
        if not n_pairs:
            return pack_reply(torch.empty(0, hidden, dtype=dtype))
        start = time.perf_counter()
        with torch.no_grad(), phase_of(provider, n_tokens):
            y = pair_outputs(request.rows, request.rows_of, layer, request.ids, provider, acts[layer], request.bias)
        tally.computed(request.ids, start)
        return pack_reply(y)
    except Exception as e:
        log.exception("this rank could not compute its pairs of MoE layer %d", layer)
        said = str(e) if isinstance(e, MoelaneError) else f"{type(e).__name__}: {e}"
        return pack_failure(said, reply_bytes(n_pairs, hidden, dtype))
