"""`torchrun --nproc-per-node N -m moelane run|serve|bench ...`: one rank of a distributed run (docs/distributed.md).

Rank 0 runs the command as one process would, its model's experts spread over the ranks (`moelane.dist.load`); every
other rank reads only the model flags, holds its share of the experts and computes with them until rank 0's model
is closed (`moelane.dist.serve_experts`). Imported only when torchrun's environment says this process is one of
several ranks, so a lone `moelane serve` imports nothing distributed.
"""

from __future__ import annotations

import argparse
import logging

from moelane.commands.common import DTYPES, placement_trace, set_threads
from moelane.errors import InputError

log = logging.getLogger("moelane")
COMMANDS = ("run", "serve", "bench")


def run_rank(args: argparse.Namespace) -> int:
    """This process's part of the run -> its exit code."""
    from moelane import dist

    if args.command not in COMMANDS:
        raise InputError(f"moelane {args.command} does not run distributed; under torchrun: {', '.join(COMMANDS)}")
    if not 0 < args.dist_timeout < float("inf"):
        raise InputError(f"--dist-timeout must be a finite number of seconds > 0, got {args.dist_timeout}")
    placement_trace(args, distributed=True)  # (its flags checked on every rank before they meet)
    ranks = dist.join(args.dist_timeout)
    try:
        if ranks.rank == 0:
            args.ranks = ranks
            return int(args.func(args))
        set_threads(args)
        if args.pager_policy and args.expert_memory is None:
            raise InputError("--pager-policy chooses what the expert pool evicts: it needs --expert-memory")
        dist.serve_experts(ranks, args.model, DTYPES[args.dtype], expert_memory=args.expert_memory,
                           host_memory=args.host_memory, policy=args.pager_policy or "planner",
                           default_tier=args.default_tier)  # fmt: skip
        log.info("rank %d: rank 0 closed the model; stopping", ranks.rank)
        return 0
    finally:
        ranks.close()
