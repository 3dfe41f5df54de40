"""Expert parallelism over several processes and hosts, on torch.distributed (gloo, CPU): one model's routed experts
spread over ranks, each rank paging its share under its own memory budget.

Layout. Rank 0 holds the dense weights and runs everything else (attention, routers, shared experts, the lanes engine,
the HTTP server). Routed experts are split over all ranks, rank 0 included, each rank holding as many experts of every
MoE layer as its contiguous range of ids (`Placement`: those ranges, or experts balanced by a trace's routing counts,
rank 0's choice for all); each rank holds its share in its own provider, every expert resident or an expert store
under its own `--expert-memory`, built by the same factories as in one process.

One MoE layer of one pass, on rank 0 (`SpreadExperts.pair_outputs`; the workers' side is `worker.serve_layers`):

    owner  = owners[layer][ids]                       # [P]: the rank of each (token, expert) pair's expert
    header -> every rank (control group)              # the layer, and each rank's numbers of rows and pairs
    rows, pairs -> their owners (data group)          # one all-to-all: each rank gets only its pairs' rows
    y[own] = pair_outputs(own pairs)                  # rank 0's share, while the others compute theirs
    y[theirs] <- their owners (data group)            # one all-to-all back
    out = weighted_sum(y, weights)                    # in model.experts, over k in the one fixed order

A layer whose pairs all fall in rank 0's share exchanges nothing.

Identity: a pair's output depends only on its row and its expert's weights (model.experts: batch-invariant
products), and every rank computes its pairs with the same code, from the same weights in the same dtype, as one
process would; rank 0 then sums each token's k outputs in the same order as one process. So logits, and replies, are
bit-identical to one process's. Rendezvous makes sure the ranks can agree: each rank's `fingerprint` (the config,
the experts' shapes, the compute dtype and tier, the kernels' backend, a digest of the first expert) must equal rank
0's, or every rank stops with `RankMismatch` naming the first difference.

Faults. Workers wait for work on a control group that never times out (a server may idle for hours); the exchange
itself runs on a data group with the `--dist-timeout` of the launch. A rank that dies (its connections close) or
stops answering (the timeout) fails the pass on rank 0 with `RankFailure` (an `Unavailable`: the server answers 503
and reports itself degraded on /health), and every later pass fails the same way at once: no hang, and no token
computed without a rank's experts. An error inside a rank's computation (its store too small for a pass, say) is
sent back and fails that pass only (`RankError`); the exchange stays in step.

Nothing here is imported by a process that is not launched distributed (`moelane.commands` looks at torchrun's
environment first).
"""

from moelane.dist.errors import RankError, RankFailure, RankMismatch
from moelane.dist.launch import load, serve_experts
from moelane.dist.placement import Placement
from moelane.dist.ranks import Ranks, join

__all__ = ["Placement", "RankError", "RankFailure", "RankMismatch", "Ranks", "join", "load", "serve_experts"]
