"""Starting a distributed run: rank 0 loads the model (`load`), every other rank its share of the experts
(`serve_experts`); both meet twice on the control group before any pass:

    agree:  every rank's fingerprint equals rank 0's, or all stop with RankMismatch naming the difference
    ready:  every rank has built its share (or all stop with the error of the rank that could not), and says the
            most rows a pass may route through it, so rank 0 fits its prefill chunk to the smallest

Experts are held as in one process (`moelane.loading.expert_factory`: all resident where they fit, else an expert
store under the rank's own `expert_memory`), without the pager's predictors and planner, which see the routing of
a whole layer on rank 0 only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from moelane.dist.errors import RankError, RankMismatch
from moelane.dist.fingerprint import difference, fingerprint
from moelane.dist.placement import Placement
from moelane.dist.ranks import Ranks
from moelane.dist.routing import routing_counts
from moelane.dist.spread import SpreadExperts
from moelane.dist.worker import serve_layers
from moelane.errors import InputError, MoelaneError
from moelane.loading import expert_factory
from moelane.model.checkpoint import ExpertHandle
from moelane.model.config import Config
from moelane.model.experts import Act
from moelane.model.family import Family
from moelane.model.lm import LM
from moelane.model.load import ProviderFactory, read_experts
from moelane.model.load import load as load_folder
from moelane.model.moe import MoeBlock
from moelane.model.provider import ExpertProvider
from moelane.pager.live.memory import MemorySpec, format_bytes

Handles = dict[int, list[ExpertHandle]]


def load(
    ranks: Ranks,
    path: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    *,
    expert_memory: MemorySpec | str | None = None,
    host_memory: MemorySpec | str | None = None,
    policy: str = "planner",
    default_tier: str = "native",
    progress: bool = False,
    quantize: str = "auto",
    provider: ProviderFactory | None = None,
    placement_trace: str | Path | None = None,
) -> LM:
    """Rank 0's model, as `moelane.load` (the same settings, for rank 0's own share of the experts), its experts
    spread over `ranks`: contiguously, or balanced by the routing counted in `placement_trace` (a `moelane trace`
    file of this model), rank 0's choice for every rank. Its passes run eagerly (the decode step is not compiled).
    `provider`: a factory of one's own for rank 0's share, in place of the expert settings."""
    if ranks.rank != 0:
        raise ValueError(f"rank {ranks.rank} serves experts (serve_experts); rank 0 loads the model")
    factory = share_factory(expert_memory, host_memory, policy, default_tier, progress, provider)
    config, _, handles, compute = read_experts(path, dtype)
    placement = agree(ranks, config, handles, compute, default_tier, placement_trace)
    top_k = config.top_k or 1

    def build(handles: Handles, dtype: torch.dtype) -> ExpertProvider:
        local, limits = ready(ranks, lambda: factory(placement.share(handles, 0), dtype), top_k)
        return SpreadExperts(ranks, placement, local, dims_of(handles), dtype, limits)

    lm = load_folder(path, dtype, provider=build, progress=progress, quantize=quantize)
    lm.prefill_chunk = min(lm.prefill_chunk, lm.max_pass_rows() or lm.prefill_chunk)
    return lm


def serve_experts(
    ranks: Ranks,
    path: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    *,
    expert_memory: MemorySpec | str | None = None,
    host_memory: MemorySpec | str | None = None,
    policy: str = "planner",
    default_tier: str = "native",
    progress: bool = False,
    provider: ProviderFactory | None = None,
) -> None:
    """A rank other than 0: hold this rank's share of the model's experts and compute with them until rank 0's
    model is closed. Reads no dense weight. RankFailure if rank 0 goes away."""
    if ranks.rank == 0:
        raise ValueError("rank 0 loads the model (load); the other ranks serve experts")
    factory = share_factory(expert_memory, host_memory, policy, default_tier, progress, provider)
    config, family, handles, compute = read_experts(path, dtype)
    placement = agree(ranks, config, handles, compute, default_tier)
    local, _ = ready(ranks, lambda: factory(placement.share(handles, ranks.rank), compute), config.top_k or 1)
    try:
        n_experts = sum(len(placement.experts(layer, ranks.rank)) for layer in placement.owners)
        serve_layers(ranks, local, layer_acts(family, config), dims_of(handles), compute, n_experts)
    finally:
        close = getattr(local, "close", None)
        if close is not None:
            close()


# The tiers a distributed run takes: native, and auto, which is native there (a GGUF's own codes included).
NATIVE = ("native", "auto")


def share_factory(expert_memory: MemorySpec | str | None, host_memory: MemorySpec | str | None, policy: str,
                  default_tier: str, progress: bool, provider: ProviderFactory | None) -> ProviderFactory:  # fmt: skip
    """The factory of a rank's share: its own, or `moelane.load`'s for these settings (checked before loading)."""
    if provider is not None:
        if (expert_memory, host_memory, policy, default_tier in NATIVE) != (None, None, "planner", True):
            raise ValueError("give either an expert provider factory or expert settings, not both")
        return provider
    if default_tier not in NATIVE:  # (a tier file holds a whole model's experts; a share's would overwrite it)
        raise InputError("a distributed run holds experts at the native tier only (--default-tier native)")
    return expert_factory(expert_memory, host_memory, policy, "native", progress)


def agree(ranks: Ranks, config: Config, handles: Handles, dtype: torch.dtype, default_tier: str,
          placement_trace: str | Path | None = None) -> Placement:  # fmt: skip
    """Rank 0's placement (it alone reads `placement_trace`), for every rank, once every rank's fingerprint equals
    rank 0's (else RankMismatch on every rank, naming the first difference). Where rank 0 could not place the
    experts, every rank stops with its InputError."""
    if not any(handles.values()):
        raise InputError("this model has no routed experts (a dense model): there is nothing to spread over ranks")
    placement, problem = None, None
    if ranks.rank == 0:
        try:
            placement = place(handles, config.top_k or 1, ranks.world, placement_trace)
        except InputError as e:
            problem = str(e)
    reports: list[tuple[dict[str, str], Placement | None, str | None] | None] = [None] * ranks.world
    dist.all_gather_object(reports, (fingerprint(config, handles, dtype, default_tier), placement, problem),
                           group=ranks.control)  # fmt: skip
    assert reports[0] is not None
    ours, placement, problem = reports[0]
    for rank, report in enumerate(reports[1:], 1):
        assert report is not None
        if (diff := difference(ours, report[0], rank)) is not None:
            raise RankMismatch(diff)
    if problem is not None or placement is None:
        raise InputError(problem or "rank 0 chose no placement")
    return placement


def place(handles: Handles, top_k: int, world: int, placement_trace: str | Path | None) -> Placement:
    """Contiguous, or balanced by the routing counted in `placement_trace`."""
    layers = sorted(layer for layer, hs in handles.items() if hs)
    n_experts = len(handles[layers[0]])
    if world > n_experts:
        raise InputError(f"{world} ranks for {n_experts} experts a layer: at most one rank per expert")
    if placement_trace is None:
        return Placement.contiguous(layers, n_experts, world)
    return Placement.balanced(routing_counts(placement_trace, layers, n_experts, top_k), world)


def ready(ranks: Ranks, build: Callable[[], ExpertProvider], top_k: int) -> tuple[ExpertProvider, list[int | None]]:
    """This rank's provider, built, once every rank has built its own: -> (it, each rank's most rows a pass).
    RankError on every rank if one could not build its share."""
    local, error = None, None
    try:
        local = build()
        error = too_small(local, top_k)
    except MoelaneError as e:
        error = str(e)
    max_rows = getattr(local, "max_rows", None)
    limit = int(max_rows(top_k)) if callable(max_rows) else None
    reports: list[tuple[int | None, str | None] | None] = [None] * ranks.world
    dist.all_gather_object(reports, (limit, error), group=ranks.control)
    failed = [(rank, report[1]) for rank, report in enumerate(reports) if report is not None and report[1]]
    if failed or local is None:
        close = getattr(local, "close", None)
        if close is not None:
            close()
        raise RankError("; ".join(f"rank {rank} could not hold its experts: {why}" for rank, why in failed))
    return local, [report[0] if report is not None else None for report in reports]


def too_small(local: ExpertProvider, top_k: int) -> str | None:
    """Why a rank's store cannot run a pass (it holds fewer experts than one token may route to in its share of a
    MoE layer), else None."""
    n_slots, n_experts = getattr(local, "n_slots", None), getattr(local, "n_experts", None)
    if n_slots is None or n_experts is None or n_slots >= (need := min(top_k, n_experts)):
        return None
    size = format_bytes(need * local.slot_bytes)  # type: ignore[attr-defined]
    return (f"its --expert-memory holds {n_slots} expert{'s' * (n_slots != 1)}, but a token may route to {need} of "
            f"its experts in one MoE layer: give it at least {size}")  # fmt: skip


def layer_acts(family: Family[Config], config: Config) -> dict[int, Act]:
    """Each MoE layer's expert activation, from the family's decoder built without weights (on the meta device)."""
    with torch.device("meta"):
        model = family.build(config)
    blocks = {i: next(m for m in model.model.layers[i].modules() if isinstance(m, MoeBlock)) for i in model.moe_layers}
    return {i: block.act for i, block in blocks.items()}


def dims_of(handles: Handles) -> tuple[int, int]:
    """(H, I) of the model's experts."""
    return next(hs for hs in handles.values() if hs)[0].dims
