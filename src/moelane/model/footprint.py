"""What a decode pass reads from memory, in bytes: on a model whose weights do not fit in the caches, its cost.

A pass reads every dense weight once (attention, dense MLPs, shared experts, routers, norms, the LM head; of the
embeddings only its own rows, counted as nothing) and, in each MoE layer, each distinct expert its rows route to once,
at the tier it is held: `moelane.kernels`' gather_linear reads a slot's bytes once a call for every pair that uses it.
So a round of many streams costs `dense + expert x (distinct experts, summed over MoE layers)` bytes, whatever its
rows. The lanes engine prices rounds by these bytes (`moelane.lanes.cost`); `bench/round_cost.py` sets a round's
measured time against them over a measured bandwidth.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moelane.kernels import Pool


@dataclass(frozen=True, slots=True)
class Footprint:
    """dense: bytes every pass reads; expert: one routed expert's bytes as held (the mean over its layer's pool slots
    where tiers mix); n_layers MoE layers of n_experts experts, top_k of them per row."""

    dense: int
    expert: float
    n_layers: int
    n_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.dense < 0 or self.expert < 0 or min(self.n_layers, self.n_experts, self.top_k) < 1:
            raise ValueError(f"a footprint needs bytes >= 0 and at least one MoE layer, expert and pick: {self}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k {self.top_k} exceeds the {self.n_experts} experts")

    def pass_bytes(self, distinct: float) -> float:
        """Bytes of a pass whose MoE layers route to `distinct` experts in all (summed over the layers)."""
        return self.dense + self.expert * distinct

    def expected_distinct(self, rows: float) -> float:
        """Distinct experts one MoE layer is expected to route `rows` independent rows to, each picking top_k of
        n_experts as if at random: E (1 - (1 - k/E)^rows). (Counted on the inflated model's open prompts, 4 / 7.4 /
        13.3 / 19.4 / 25.8 at 1 / 2 / 4 / 8 / 16 streams, against 4 / 7.5 / 13.1 / 20.5 / 27.1 from this.)"""
        return self.n_experts * (1.0 - float((1.0 - self.top_k / self.n_experts) ** rows))

    def expected_bytes(self, rows: float) -> float:
        """A pass's bytes for `rows` independent rows (`expected_distinct` in every MoE layer)."""
        return self.pass_bytes(self.n_layers * self.expected_distinct(rows))


def footprint(lm: Any) -> Footprint | None:
    """The footprint of a loaded `LM` (None for a model without routed experts)."""
    if not lm.moe_layers or not lm.args.num_experts_per_tok:
        return None
    per_slot = [expert_bytes(lm.provider, layer) for layer in lm.moe_layers]
    return Footprint(dense_bytes(lm.model), sum(per_slot) / len(per_slot), len(lm.moe_layers), lm.args.num_experts,
                     lm.args.num_experts_per_tok)  # fmt: skip


def expert_bytes(provider: Any, layer: int) -> float:
    """Bytes of one expert of `layer` as its provider holds it: its pools' over their slots, or what a provider
    without pools of its own (a distributed run's) says."""
    own = getattr(provider, "expert_bytes", None)
    if callable(own):
        return float(own(layer))
    pools = provider.pools(layer)
    held = sum(tensor_bytes(t for part in (p.w13, p.w2) for t in part) for p in pools)
    return float(held / sum(p.n_slots for p in pools))


def dense_bytes(model: nn.Module) -> int:
    """Bytes of the weights a pass reads whole: every module's parameters and kernel pools but the embeddings' (a
    tied LM head reads the embedding matrix whole: it is counted as the head's). Each byte once: a pool that views
    another's rows (`Attention.fuse_projections`) adds nothing."""
    spans: list[tuple[int, int]] = []  # (first byte, end) of each tensor in memory
    elsewhere = 0  # tensors with no address (the meta device), each counted whole, once
    seen: set[int] = set()

    def add(t: torch.Tensor | None) -> None:
        nonlocal elsewhere
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        size = t.numel() * t.element_size()
        if t.device.type == "meta":
            elsewhere += size
        else:
            spans.append((t.data_ptr(), t.data_ptr() + size))

    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    for module in model.modules():
        for name, value in vars(module).items():
            if isinstance(value, Pool):
                add(value.data)
                add(value.scales)
            elif name == "_parameters":
                for p in value.values():
                    if p is not None and (id(p) not in embeddings or id(p) in heads):
                        add(p)
    total, end = 0, 0
    for first, last in sorted(spans):  # the union of the spans
        total += max(0, last - max(first, end))
        end = max(end, last)
    return total + elsewhere


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
