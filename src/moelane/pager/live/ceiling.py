"""The memory ceiling a run honours: the limit it runs under, the minimum a model needs, the experts' budget.

    found   = limits.memory_limit(): the tightest cgroup limit (v1, v2) over free memory, and the room left under it
    minimum = this process's memory before any weight + dense weights + one token's experts + reserve
              (checked before any weight is read: below it, StoreError, one line that names the minimum)
    budget  = room once the dense weights are in - the process's mapped file pages - reserve
              (free memory only: less `HEADROOM` of it as well, for the machine's other processes)
    reserve = one stream's KV cache at the full context + `WORK_BYTES` (passes' activations, the I/O threads' bounce
              buffers, the allocator's slack; measured in docs/pager.md, "Bigger than memory")

One token's experts are `top_k` experts in each MoE layer at the default tier: with that much a decode token reads
each expert it routes to once, whatever the pool held before. Without `--expert-memory` every expert is resident
where they all fit the budget, else a store pages them within it; with it, the flag's budget is used as given, and
the minimum is checked all the same. `MemoryReport` is what `moelane run --stats` and `/metrics` show.

The libraries' file pages (torch's code) are set aside whole, though the kernel could reclaim them: a budget that
left them to the reserve had the process refault its own code without end under a 50% ceiling (1.1 TB read in 13
minutes, never killed), the thrash a limit brings instead of an OOM kill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from moelane.model.checkpoint import ExpertHandle
from moelane.model.load import MemoryNeeds
from moelane.pager.live.limits import memory_limit, process_memory
from moelane.pager.live.memory import MemorySpec, format_bytes
from moelane.pager.live.store import StoreError
from moelane.pager.live.tiers import default_tier as tier_of
from moelane.pager.live.tiers import expert_slot_bytes

log = logging.getLogger(__name__)

# What a fitting expert pool leaves of the memory still free, where no limit is set: other processes' growth.
HEADROOM = 0.15
# Passes' work memory, the I/O threads' bounce buffers (4 x 4 MiB) and the allocator's slack: a 600-token prompt's
# prefill (256-row chunks) peaked ~80 MB over the loaded inflated model's RSS (docs/pager.md, "Bigger than memory").
WORK_BYTES = 96 << 20
FLAG = "--expert-memory"


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """`limit`: the ceiling found, bytes (None: only free memory, `room` of it); `source`: where it comes from
    ("cgroup v1 /a", "free memory", or "--expert-memory", whose budget is then the limit); `minimum`: the least
    limit the whole process runs under with this model (None before the model is known; with --expert-memory it is
    still the process's, not the experts'); `budget`: the experts' bytes allowed (None until decided);
    `resident`: all experts held."""

    source: str
    limit: int | None
    room: int
    minimum: int | None = None
    budget: int | None = None
    resident: bool = False

    def lines(self) -> list[str]:
        """The report as `moelane run --stats` prints it."""
        limit = format_bytes(self.limit) if self.limit is not None else f"none ({format_bytes(self.room)} free)"
        parts = [f"{'expert memory' if self.source == FLAG else 'memory limit'} {limit} from {self.source}"]
        if self.minimum is not None:
            parts.append(f"needs a limit of at least {format_bytes(self.minimum)}")
        if self.budget is not None:
            held = "all resident" if self.resident else "paged"
            parts.append(f"expert budget {format_bytes(self.budget)} ({held})")
        return ["; ".join(parts)]


class Ceiling:
    """The ceiling of one load: `check` before any weight is read, `budget` once the dense weights are in."""

    def __init__(self, flag: MemorySpec | None = None, default_tier: str = "native") -> None:
        self.flag, self.tier = flag, default_tier  # (resolved for the model's experts in `check`: `tiers.default_tier`)
        found = memory_limit()
        self.report = MemoryReport(found.source, found.limit, found.room)
        self.needs: MemoryNeeds | None = None

    def check(self, needs: MemoryNeeds, handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> None:
        """StoreError, before any weight is read, where the room left is below what this model needs at least."""
        self.needs = needs
        found, own = memory_limit(), process_memory()
        token = one_token_bytes(needs, handles, dtype, tier_of(self.tier, handles))
        minimum = own.anon + own.file + needs.dense_bytes + token + reserve(needs)
        self.report = replace(self.report, minimum=minimum, room=found.room)
        if not token or found.room + own.anon >= minimum:
            return
        where = (f"the memory limit is {format_bytes(found.limit)} ({found.source})" if found.limit is not None
                 else f"{format_bytes(found.room + own.anon)} of memory is free")  # fmt: skip
        raise StoreError(
            f"{where}, below the {format_bytes(minimum)} this model needs at least (dense weights "
            f"{format_bytes(needs.dense_bytes)} + one token's experts {format_bytes(token)} + overhead "
            f"{format_bytes(minimum - needs.dense_bytes - token)}): raise the limit"
        )

    def budget(self, need: int) -> int:
        """The experts' budget now that the dense weights are in (`need`: every expert at the default tier)."""
        found, own = memory_limit(), process_memory()
        room = int(found.room * (1 - HEADROOM)) if found.limit is None else found.room
        budget = max(0, room - own.file - reserve(self.needs))
        self.report = replace(self.report, budget=min(budget, need), resident=need <= budget)
        return budget

    def flagged(self, budget: int, resident: bool) -> None:
        """Record the budget `--expert-memory` gave: the flag is then the budget's source."""
        self.report = replace(self.report, source=FLAG, limit=budget, budget=budget, resident=resident)


def reserve(needs: MemoryNeeds | None) -> int:
    """Memory kept for what is not weights: one stream's KV cache at the full context and `WORK_BYTES`."""
    return WORK_BYTES + (needs.kv_bytes if needs is not None else 0)


def one_token_bytes(needs: MemoryNeeds, handles: dict[int, list[ExpertHandle]], dtype: torch.dtype, tier: int) -> int:
    """The experts one token routes to (`top_k` in each MoE layer), held at `tier`."""
    if not any(handles.values()):
        return 0
    return needs.n_moe_layers * needs.top_k * expert_slot_bytes(tier, handles, dtype)
