"""Choosing and building a run's expert provider (an expert store, or all experts resident); the store's stats text.

`store_factory` and `fitting_factory` turn a run's settings (expert and host memory, eviction policy, default tier)
into the provider factory that `moelane.model.load.load` calls with the model's expert handles and compute dtype;
`moelane.load` chooses between them. `store_factory` checks its settings when called, before any weight is loaded;
its pool budget is bytes or a share of all expert bytes in the compute dtype (`expert_count_and_bytes`; so 25% holds
~3.5x the experts at int4 that it holds at bf16), host-memory shares refer to the bytes as stored. Both decide by the
experts' bytes at the default tier: where every expert fits at a quantised tier (in the budget, or without one in
the budget `ceiling.Ceiling` derives from the limit the process runs under), they are all resident at that tier
(`resident_at_tier`: one pool a layer, slot == expert id, no pager); otherwise a store pages them (at native,
`store_factory` builds a store even for a budget that holds every expert). Budgets arrive parsed, as `MemorySpec`s.
With a `device` (CUDA), the pools (the store's, or the all-resident ones) are device memory under the expert budget,
the host cache pinned host RAM behind them (transfer.py); None or the CPU: host memory.
`format_stats` is the text `moelane run --stats` prints.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from moelane.device import expert_room
from moelane.kernels import hugepages
from moelane.model.checkpoint import ExpertHandle
from moelane.model.provider import ExpertProvider, ResidentProvider, TierPool, tier_pool
from moelane.pager.live.ceiling import Ceiling, MemoryReport
from moelane.pager.live.memory import MemorySpec, format_bytes
from moelane.pager.live.stats import format_counts
from moelane.pager.live.storage import Storage
from moelane.pager.live.store import ExpertStore, StoreConfig, StoreError
from moelane.pager.live.tiers import TIER_NAMES, check_default_tier, expert_slot_bytes, slot_parts, tier_format
from moelane.pager.live.tiers import default_tier as tier_of
from moelane.pager.live.transfer import make_transfer, on_device

log = logging.getLogger(__name__)
NO_EXPERTS = ("this model has no experts (a dense model): --expert-memory, --host-memory and --default-tier apply "
              "to mixture-of-experts models only")  # fmt: skip


def store_factory(
    expert_memory: MemorySpec | None = None,
    host_memory: MemorySpec | None = None,
    policy: str = "planner",
    default_tier: str = "auto",
    ceiling: Ceiling | None = None,
    progress: bool = False,
    device: torch.device | None = None,
) -> Callable[[dict[int, list[ExpertHandle]], torch.dtype], ExpertProvider]:
    """The provider factory of a run with an expert budget: an expert store, or every expert resident at a quantised
    `default_tier` where they all fit the budget at it ("auto": `tiers.default_tier`). `expert_memory`: bytes or a share
    of all expert bytes in the compute dtype (None: 100%); `host_memory`: of the experts' bytes as stored (None: no host
    cache). `ceiling` records the budget for the run's report. `progress`: bars on stderr while experts load and a
    tier file builds. `device`: where the pools live (None or the CPU: host memory; a CUDA device: device memory,
    `expert_memory` its budget, `host_memory` pinned host RAM)."""
    pool = MemorySpec(fraction=1.0) if expert_memory is None else expert_memory
    host = MemorySpec(n_bytes=0) if host_memory is None else host_memory
    try:
        check_default_tier(default_tier)
        StoreConfig(budget_bytes=1, policy=policy)
        on_device(device)
    except ValueError as e:
        raise StoreError(str(e)) from None

    def build(handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> ExpertProvider:
        if not any(handles.values()):
            raise StoreError(NO_EXPERTS)
        tier = tier_of(default_tier, handles)
        n_experts, each = expert_count_and_bytes(handles, dtype)
        stored = sum(h.nbytes for hs in handles.values() for h in hs)
        budget = pool.resolve(n_experts * each)
        if budget < 1:
            raise StoreError(f"an expert memory of {pool} holds no expert ({each} bytes each)")
        resident = tier > 0 and budget >= n_experts * expert_count_and_bytes(handles, dtype, tier)[1]
        if ceiling is not None:
            ceiling.flagged(budget, resident)
        if resident:
            return resident_at_tier(handles, dtype, tier, progress, device)
        config = StoreConfig(budget, host.resolve(stored), policy, tier)
        return ExpertStore(handles, dtype, config, progress, device)

    return build


def expert_count_and_bytes(
    handles: dict[int, list[ExpertHandle]], dtype: torch.dtype, tier: int = 0
) -> tuple[int, int]:
    """How many routed experts the model has, and the bytes of one in a pool slot at `tier` (native: in the compute
    dtype)."""
    n_experts = sum(len(hs) for hs in handles.values())
    if not n_experts:
        return 0, 0
    return n_experts, expert_slot_bytes(tier, handles, dtype)


def resident_at_tier(
    handles: dict[int, list[ExpertHandle]], dtype: torch.dtype, tier: int, progress: bool = False,
    device: torch.device | None = None,
) -> ResidentProvider:  # fmt: skip
    """Every expert resident at `tier`, one pool a layer, slot == expert id, read as the store reads a miss (storage.py:
    nothing left in the page cache, no copy of a layer between the file and its pool): at native, each expert's
    checkpoint tensors in the compute dtype (the bytes `read_expert` gives); quantised, its codes and scales read from
    the tier's file (built first if missing), or a GGUF's own Q8_0 / Q4_0 codes at their tier (`tiers.tier_format`).
    On a CUDA `device` the pools are device memory, each expert copied in through a pinned staging buffer, every copy
    landed before this returns (transfer.py)."""
    from tqdm import tqdm

    fmt = tier_format(tier, handles) if tier else None
    where = on_device(device)
    parts = slot_parts(tier, *next(iter(handles.values()))[0].dims, dtype, fmt, interleave=where is None)
    transfer = make_transfer(where, expert_slot_bytes(tier, handles, dtype), 2)
    storage = Storage(handles, 0, check_finite=tier > 0, progress=progress)
    pools: dict[int, TierPool] = {}
    desc = "loading experts" + ("" if tier == 0 else f" at {TIER_NAMES[tier]}")
    try:
        storage.tier_source(tier)  # (its tier file built first, if missing: one bar, then the next)
        with tqdm(total=sum(len(hs) for hs in handles.values()), desc=desc, unit="expert", disable=not progress,
                  leave=False, delay=1.0) as bar:  # fmt: skip
            for li, (layer, experts) in enumerate(handles.items()):
                # (on the CPU in huge-page memory: every pass streams these bytes, kernels/hugepages.py)
                t = [hugepages.empty((len(experts), *shape), part_dtype) if where is None
                     else torch.empty(len(experts), *shape, dtype=part_dtype, device=where)
                     for part_dtype, shape in parts]  # fmt: skip
                for e, handle in enumerate(experts):
                    fill = functools.partial(storage.load_into, handle, tier)
                    transfer.load(li * len(experts) + e, tuple(part[e] for part in t), fill)
                    bar.update(1)
                w13, w2 = ((t[0], None), (t[1], None)) if tier == 0 else ((t[0], t[1]), (t[2], t[3]))
                pools[layer] = tier_pool(0, TIER_NAMES[tier], w13, w2, experts[0].dims)
        transfer.settle()
    finally:
        storage.close()
    return ResidentProvider(pools)


def fitting_factory(
    host_memory: MemorySpec | None = None,
    policy: str = "planner",
    default_tier: str = "auto",
    progress: bool = False,
    ceiling: Ceiling | None = None,
    device: torch.device | None = None,
) -> Callable[[dict[int, list[ExpertHandle]], torch.dtype], ExpertProvider]:
    """The provider factory of a run without `--expert-memory`: every expert resident where they all fit the budget
    that `ceiling` derives from the limit this process runs under once the dense weights are loaded (ceiling.py; on
    a GPU, its free memory less a reserve: `moelane.device.expert_room`), else an expert store whose pool takes that
    budget, with a warning that says so. A model that does not fit then
    runs paged instead of being killed for memory halfway through loading. `device`: as `store_factory`'s."""
    store_factory(None, host_memory, policy, default_tier)  # (the store's settings checked now, before any loading)
    ceiling = Ceiling(None, default_tier) if ceiling is None else ceiling

    def build(handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> ExpertProvider:
        tier = tier_of(default_tier, handles)
        n_experts, each = expert_count_and_bytes(handles, dtype, tier)
        if not n_experts and tier > 0:
            raise StoreError(NO_EXPERTS)
        need = n_experts * each
        gpu = on_device(device)
        room = expert_room(gpu) if gpu is not None else ceiling.budget(need)
        if need <= room:  # (a dense model needs nothing)
            return resident_at_tier(handles, dtype, tier, progress, device) if n_experts else ResidentProvider({})
        report = ceiling.report
        if gpu is not None:
            where = f"{format_bytes(room)} of {gpu}'s memory is left for them"
        elif report.limit is not None:
            where = f"the memory limit is {format_bytes(report.limit)} ({report.source})"
        else:
            where = f"{format_bytes(report.room)} of memory is free"
        if room < each:
            raise StoreError(f"{where}: the experts' budget left ({format_bytes(room)}) holds no expert "
                             f"({format_bytes(each)}): raise the limit, or compute in bfloat16 (--dtype)")  # fmt: skip
        log.warning("the experts take %s in %s and %s: paging them within %s (--expert-memory sets the budget)",
                    format_bytes(need), str(dtype).removeprefix("torch."), where, format_bytes(room))  # fmt: skip
        return store_factory(MemorySpec(n_bytes=room), host_memory, policy, TIER_NAMES[tier],
                             progress=progress, device=device)(handles, dtype)  # fmt: skip

    return build


def format_stats(store: object, memory: MemoryReport | None = None, decoded: tuple[int, int] | None = None) -> str:
    """The text `moelane run --stats` prints (any provider; only a store has statistics): the memory limit found and
    the budget derived (`memory`), the store's counters, and (`decoded`: disk bytes read after the first token, tokens
    decoded after it) the disk bytes a decode token read."""
    lines = memory.lines() if memory is not None else []
    if not isinstance(store, ExpertStore):
        kind = getattr(store, "kind", "native")
        lines.append(f"expert store: not in use (all experts resident{'' if kind == 'native' else f' at {kind}'})")
        return "\n".join(lines)
    c = store.config
    held = ", ".join(f"{n} at {name}" for name, n in store.held_by_tier().items() if n)
    sizes = ", ".join(f"{format_bytes(b)} at {name}" for name, b in zip(TIER_NAMES, store.tier_bytes, strict=True))
    head = (
        f"expert store: {format_bytes(c.budget_bytes)} of {format_bytes(store.total_bytes)} "
        f"({c.budget_bytes / store.total_bytes:.0%}; {store.n_slots} experts at the default tier "
        f"{TIER_NAMES[c.default_tier]}), policy {c.policy}, host cache {format_bytes(store.storage.host.nbytes)} of "
        f"{format_bytes(c.host_bytes)}\n  held {format_bytes(store.resident_bytes)} ({held or 'none'}), high water "
        f"{format_bytes(store.high_water_bytes)}; an expert is {sizes}"
    )
    with store._cond:
        lines.extend(format_counts(store.stats, head))
    if decoded is not None and decoded[1] > 0:
        n_bytes, n_tokens = decoded
        lines.append(f"  disk per decode token {format_bytes(n_bytes / n_tokens)} ({format_bytes(n_bytes)} read for "
                     f"{n_tokens} tokens after the first)")  # fmt: skip
    return "\n".join(lines)


def disk_bytes(store: object) -> int:
    """Bytes a store has read from disk so far (0 for any other provider)."""
    if not isinstance(store, ExpertStore):
        return 0
    with store._cond:
        return sum(n for (level, _), n in store.stats.bytes_read.items() if level == "disk")
