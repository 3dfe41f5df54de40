"""Choosing and building a run's expert provider (an expert store, or all experts resident); the store's stats text.

`store_factory` and `fitting_factory` turn a run's settings (expert and host memory, eviction policy, default tier)
into the provider factory that `moelane.model.load.load` calls with the model's expert handles and compute dtype;
`moelane.load` chooses between them. `store_factory` checks its settings when called, before any weight is loaded;
its pool budget is bytes or a share of all expert bytes in the compute dtype (`expert_count_and_bytes`), host-memory
shares refer to the bytes as stored. `fitting_factory` keeps every expert resident where they all fit in the memory
still free (less `HEADROOM`), else pages them within it through `store_factory`. Budgets arrive parsed, as
`MemorySpec`s. `format_stats` is the text `moelane run --stats` prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from moelane.model.checkpoint import ExpertHandle
from moelane.model.provider import ExpertProvider, ResidentProvider
from moelane.pager.live.memory import MemorySpec, available_memory, format_bytes
from moelane.pager.live.stats import format_counts
from moelane.pager.live.store import ExpertStore, StoreConfig, StoreError
from moelane.pager.live.tiers import TIER_NAMES, parse_tier

log = logging.getLogger(__name__)


def store_factory(
    expert_memory: MemorySpec | None = None,
    host_memory: MemorySpec | None = None,
    policy: str = "planner",
    default_tier: str = "native",
) -> Callable[[dict[int, list[ExpertHandle]], torch.dtype], ExpertStore]:
    """The provider factory of a run with an expert store. `expert_memory`: bytes or a share of all expert bytes in
    the compute dtype (None: 100%); `host_memory`: of the experts' bytes as stored (None: no host cache)."""
    pool = MemorySpec(fraction=1.0) if expert_memory is None else expert_memory
    host = MemorySpec(n_bytes=0) if host_memory is None else host_memory
    try:
        tier = parse_tier(default_tier)
        StoreConfig(budget_bytes=1, policy=policy, default_tier=tier)
    except ValueError as e:
        raise StoreError(str(e)) from None

    def build(handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> ExpertStore:
        if not any(handles.values()):
            raise StoreError("this model has no experts (a dense model): --expert-memory, --host-memory and "
                             "--default-tier apply to mixture-of-experts models only")  # fmt: skip
        n_experts, each = expert_count_and_bytes(handles, dtype)
        stored = sum(h.nbytes for hs in handles.values() for h in hs)
        budget = pool.resolve(n_experts * each)
        if budget < 1:
            raise StoreError(f"an expert memory of {pool} holds no expert ({each} bytes each)")
        config = StoreConfig(budget, host.resolve(stored), policy, tier)
        return ExpertStore(handles, dtype, config)

    return build


def expert_count_and_bytes(handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> tuple[int, int]:
    """How many routed experts the model has, and the bytes of one in the compute dtype (its pool slot)."""
    n_experts = sum(len(hs) for hs in handles.values())
    if not n_experts:
        return 0, 0
    hidden, width = next(iter(handles.values()))[0].dims
    return n_experts, 3 * hidden * width * dtype.itemsize


# What a fitting expert pool leaves of the memory still free: KV caches, the passes' work and the allocator's slack.
HEADROOM = 0.15


def fitting_factory(
    host_memory: MemorySpec | None = None, policy: str = "planner", default_tier: str = "native", progress: bool = False
) -> Callable[[dict[int, list[ExpertHandle]], torch.dtype], ExpertProvider]:
    """The provider factory of a run without `--expert-memory`: every expert resident where they all fit in the
    memory still free once the dense weights are loaded (less `HEADROOM`), else an expert store whose pool takes
    that much, with a warning that says so. A model that does not fit then runs paged instead of being killed for
    memory halfway through loading."""
    store_factory(None, host_memory, policy, default_tier)  # (the store's settings checked now, before any loading)

    def build(handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> ExpertProvider:
        n_experts, each = expert_count_and_bytes(handles, dtype)
        need, free_bytes = n_experts * each, available_memory()
        room = int(free_bytes * (1 - HEADROOM))
        if need <= room:  # (a dense model needs nothing)
            return ResidentProvider.from_handles(handles, dtype, progress=progress)
        free = format_bytes(free_bytes)
        if room < each:
            raise StoreError(f"{free} of memory is free, less than one expert takes ({format_bytes(each)}): free some "
                             "memory, or compute in bfloat16 (--dtype)")  # fmt: skip
        log.warning("the experts take %s in %s, and %s of memory is free: paging them within %s (--expert-memory "
                    "sets the budget)", format_bytes(need), str(dtype).removeprefix("torch."), free,
                    format_bytes(room))  # fmt: skip
        return store_factory(MemorySpec(n_bytes=room), host_memory, policy, default_tier)(handles, dtype)

    return build


def format_stats(store: object) -> str:
    """The text `moelane run --stats` prints (any provider; only a store has statistics)."""
    if not isinstance(store, ExpertStore):
        return "expert store: not in use (all experts resident)"
    c = store.config
    head = (
        f"expert store: {store.n_slots} slots x {format_bytes(store.slot_bytes)} = "
        f"{format_bytes(store.n_slots * store.slot_bytes)} of {format_bytes(store.total_bytes)} "
        f"({store.n_slots * store.slot_bytes / store.total_bytes:.0%}), policy {c.policy}, "
        f"default tier {TIER_NAMES[c.default_tier]}, host cache {format_bytes(store.storage.host.nbytes)} "
        f"of {format_bytes(c.host_bytes)}, resident high water {format_bytes(store.high_water_bytes)}"
    )
    with store._cond:
        return "\n".join(format_counts(store.stats, head))
