"""`moelane.load`: a model folder -> an `LM` ready to run, its experts resident or paged as the settings say.

Without a budget every expert is resident, at the default tier, where they all fit the budget derived from the
limit the process runs under (a cgroup's, else free memory: `pager.live.ceiling`), and paged within it otherwise
(`fitting_factory`); with one (`expert_memory`, `host_memory`) an expert store holds them under it, or, at a
quantised `default_tier` whose experts all fit the budget, they are all resident at that tier (`store_factory`). Either
way a limit below the model's minimum is refused before any weight is read, and `lm.memory` reports the limit found.
A store built here is attached to the model before it is returned (lease release after each MoE block, the
predictors, and the live planner under the "planner" policy) and the model's prefill chunk is fitted to its pool: a
library caller gets what `moelane run` and `moelane serve` run. `provider=` takes a factory of one's own instead, and
its provider is used as it comes (nothing attached, nothing fitted, no memory check).

Budgets are parsed once, where they are given: the command line parses its flags into `MemorySpec`s, and text given
to `load` is parsed here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moelane.device import parse as parse_device
from moelane.model.lm import LM
from moelane.model.load import ProviderFactory
from moelane.model.load import load as load_folder
from moelane.pager.live.build import fitting_factory, store_factory
from moelane.pager.live.ceiling import Ceiling
from moelane.pager.live.memory import MemorySpec, parse_memory
from moelane.pager.live.store import ExpertStore, StoreError
from moelane.pager.live.tiers import check_default_tier


def load(
    path: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    *,
    expert_memory: MemorySpec | str | None = None,
    host_memory: MemorySpec | str | None = None,
    policy: str = "planner",
    default_tier: str = "auto",
    compile: bool = False,
    progress: bool = False,
    provider: ProviderFactory | None = None,
    quantize: str = "auto",
    device: str | torch.device | None = None,
) -> LM:
    """Load a model folder (None: the shipped default model) to compute in `dtype` ("auto": the checkpoint's own).

    `expert_memory`: the expert pool's budget, bytes (`"2GiB"`) or a share of all expert bytes in the compute dtype
    (`"25%"`; experts held at a quantised tier take fewer of those bytes each); `host_memory`: for host-RAM copies
    of experts' stored forms (bytes, or a share of the bytes as stored); `policy`: what the pool evicts ("planner",
    "lru", "lfu"); `default_tier`: the precision experts are held at unless a plan pins them at another ("native",
    "int8", "int4"; "auto": int8 for a GGUF whose experts are Q8_0, int4 for Q4_0, holding the file's own codes; for
    a GGUF of K-quants and other block types, the nearest tier, requantised once into a tier file beside it; else
    native). `compile` compiles the one-token decode step; `progress` shows a progress bar while resident experts
    load. `provider`: an expert provider factory of one's own, called with the experts' disk handles and the compute
    dtype, in place of the four settings before it. `quantize` ("int8", "int4") holds the dense projections
    (attention, dense MLPs, shared experts, the LM head) quantised, as a llama.cpp Q8_0 / Q4_0 file holds a model
    (the LM head at int8 under "int4" too);
    "auto" holds a GGUF's Q8_0 / Q4_0 projections as the file's own codes (int8 / int4, never requantised), its
    other block-quantised ones at their nearest tier, and anything else as stored ("none"); the routed experts'
    precision is `default_tier`'s. `device` ("cpu", "cuda", "cuda:N"; None: the CPU): where the model computes,
    its dense weights, KV caches and expert pool held there (`moelane.device`); on a CUDA device `expert_memory`
    is the device pool's budget and `host_memory` pinned host RAM behind it."""
    where = parse_device(device)
    if provider is not None:
        if (expert_memory, host_memory, policy, default_tier) != (None, None, "planner", "auto"):
            raise ValueError("give either an expert provider factory or expert settings, not both")
        return load_folder(path, dtype, provider=provider, compile=compile, progress=progress, quantize=quantize,
                           device=where)  # fmt: skip
    ceiling = memory_ceiling(expert_memory, default_tier)
    factory = expert_factory(expert_memory, host_memory, policy, default_tier, progress, ceiling, where)
    lm = load_folder(path, dtype, provider=factory, compile=compile, progress=progress, quantize=quantize,
                     preflight=ceiling.check, device=where)  # fmt: skip
    lm.memory = ceiling.report
    if isinstance(lm.provider, ExpertStore):  # (after `compile`: the hooks are made for a compiled step)
        lm.provider.attach(lm)
        lm.prefill_chunk = min(lm.prefill_chunk, lm.max_pass_rows() or lm.prefill_chunk)
    return lm


def expert_factory(
    expert_memory: MemorySpec | str | None = None,
    host_memory: MemorySpec | str | None = None,
    policy: str = "planner",
    default_tier: str = "auto",
    progress: bool = False,
    ceiling: Ceiling | None = None,
    device: torch.device | None = None,
) -> ProviderFactory:
    """The provider factory `load` builds the experts with for these settings (see `load`); checked now. `ceiling`
    decides the budget where none is given, and records the one given (default: one of its own)."""
    pool, host = memory_spec("expert_memory", expert_memory), memory_spec("host_memory", host_memory)
    if pool is None and host is None:
        return fitting_factory(None, policy, default_tier, progress=progress, ceiling=ceiling, device=device)
    return store_factory(pool, host, policy, default_tier, ceiling=ceiling, progress=progress, device=device)


def memory_ceiling(expert_memory: MemorySpec | str | None, default_tier: str) -> Ceiling:
    """The limit this process runs under, for a model's experts held at `default_tier` (StoreError for a bad tier)."""
    try:
        check_default_tier(default_tier)
        return Ceiling(memory_spec("expert_memory", expert_memory), default_tier)
    except ValueError as e:
        raise StoreError(str(e)) from None


def memory_spec(name: str, value: MemorySpec | str | None) -> MemorySpec | None:
    """`value` as a `MemorySpec`: text is parsed (StoreError naming `name` if it is not a memory size)."""
    if not isinstance(value, str):
        return value
    try:
        return parse_memory(value)
    except ValueError as e:
        raise StoreError(f"{name}: {e}") from None
