"""`Ranks`: this process's place in a distributed run, and the two gloo groups it talks on.

- control: rendezvous, and the header that starts each exchange; it never times out, so workers wait for work as
  long as rank 0 idles (a rank that dies still ends the wait: its connections close).
- data: the exchange's rows and outputs, with the launch's timeout: a rank that stops answering fails the pass on
  rank 0 within `timeout_s`.

The groups are objects passed around, not module state: torch.distributed keeps its default group globally, which
`join` creates and `Ranks.close` destroys, so one process is one rank of at most one run at a time.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)
FOREVER = timedelta(days=365)  # the control group's timeout: workers wait for rank 0 for as long as it runs
RENDEZVOUS_S = 600.0  # at least this long for the ranks to find each other (torchrun starts them one by one)


@dataclass(frozen=True, slots=True)
class Ranks:
    rank: int
    world: int
    timeout_s: float
    control: Any  # the groups (torch.distributed.ProcessGroup)
    data: Any

    def close(self) -> None:
        """Leave the run (after the last exchange)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def join(timeout_s: float = 30.0, init_method: str = "env://", rank: int | None = None,
         world: int | None = None) -> Ranks:  # fmt: skip
    """Join the run torchrun started (its RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment), or the
    one `init_method` names with `rank` and `world` given. `timeout_s`: how long rank 0 waits for another rank's part
    of an exchange before it declares that rank failed."""
    if not timeout_s > 0:
        raise ValueError(f"the distributed timeout must be > 0 seconds, got {timeout_s}")
    if rank is None or world is None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(timeout_s, RENDEZVOUS_S)))  # fmt: skip
    control = dist.new_group(backend="gloo", timeout=FOREVER)
    data = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    log.debug("rank %d of %d joined", rank, world)
    return Ranks(rank, world, timeout_s, control, data)
