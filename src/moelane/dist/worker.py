"""A rank other than 0: compute this rank's pairs of each exchange rank 0 starts, until rank 0 says stop.

    head  <- rank 0 (control)          # which layer, how many rows and pairs each rank gets
    rows  <- rank 0 (data)             # this rank's pairs' rows and local expert ids
    y      = pair_outputs(...)         # as one process would compute these pairs
    y     -> rank 0 (data)             # or the error that stopped it: the ranks stay in step either way

A rank needs no dense weight: its experts' handles, and each MoE layer's activation (`launch.layer_acts`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moelane.dist.errors import RankFailure
from moelane.dist.ranks import Ranks
from moelane.dist.spread import phase_of
from moelane.dist.wire import HEAD, STOP, header, pack_failure, pack_reply, reply_bytes, request_bytes, unpack_request
from moelane.errors import MoelaneError
from moelane.model.experts import Act, pair_outputs
from moelane.model.provider import ExpertProvider

log = logging.getLogger(__name__)


def serve_layers(ranks: Ranks, provider: ExpertProvider, acts: dict[int, Act], dims: tuple[int, int],
                 dtype: torch.dtype) -> None:  # fmt: skip
    """Answer rank 0's exchanges with this rank's experts (`provider`, local ids) until it sends STOP. `acts`: each
    MoE layer's activation; dims: (H, I). RankFailure when rank 0 goes away."""
    world, nothing = ranks.world, torch.empty(0, dtype=torch.uint8)
    head = header(STOP, world)
    while True:
        try:
            dist.broadcast(head, 0, group=ranks.control)
        except RuntimeError as e:
            raise RankFailure(f"rank 0 went away: {e}") from None
        op, layer, n_tokens, has_bias = head[:HEAD].tolist()
        if op == STOP:
            return
        n_rows, n_pairs = head[HEAD + 2 * ranks.rank : HEAD + 2 * ranks.rank + 2].tolist()
        blob = torch.empty(request_bytes(n_rows, n_pairs, *dims, dtype, bool(has_bias)), dtype=torch.uint8)
        to_rank0 = [0] * world
        try:
            dist.all_to_all_single(blob, nothing, [blob.numel()] + to_rank0[1:], to_rank0, group=ranks.data)
            reply = answer(blob, provider, acts, dims, dtype, (layer, n_tokens, n_rows, n_pairs, bool(has_bias)))
            dist.all_to_all_single(nothing, reply, to_rank0, [reply.numel()] + to_rank0[1:], group=ranks.data)
        except RuntimeError as e:
            raise RankFailure(f"rank 0 went away or fell out of step: {e}") from None


def answer(blob: torch.Tensor, provider: ExpertProvider, acts: dict[int, Act], dims: tuple[int, int],
           dtype: torch.dtype, what: tuple[int, int, int, int, bool]) -> torch.Tensor:  # fmt: skip
    """The reply to one request: its pairs' outputs, or the error that stopped them."""
    layer, n_tokens, n_rows, n_pairs, has_bias = what
    hidden, width = dims
    try:
        request = unpack_request(blob, n_rows, n_pairs, hidden, width, dtype, has_bias)
        if not n_pairs:
            return pack_reply(torch.empty(0, hidden, dtype=dtype))
        with torch.no_grad(), phase_of(provider, n_tokens):
            y = pair_outputs(request.rows, request.rows_of, layer, request.ids, provider, acts[layer], request.bias)
        return pack_reply(y)
    except Exception as e:
        log.exception("this rank could not compute its pairs of MoE layer %d", layer)
        said = str(e) if isinstance(e, MoelaneError) else f"{type(e).__name__}: {e}"
        return pack_failure(said, reply_bytes(n_pairs, hidden, dtype))
