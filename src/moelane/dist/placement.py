"""Which rank holds which routed expert of each MoE layer (docs/distributed.md#placement).

Invariant: in every MoE layer, rank r holds exactly `share_sizes(E, W)[r]` experts, the size of its contiguous range
[r*E//W, (r+1)*E//W), at least one. So a rank's share has the same number of experts, and bytes, under any placement
(its `--expert-memory` means the same), and every layer of a share has as many experts (an expert store's shape).
Within a share, experts are in ascending global id: the rank's local expert i of a layer is `experts(layer, r)[i]`.

    contiguous:  rank r holds ids [r*E//W, (r+1)*E//W) in every layer
    balanced:    per layer, experts by descending routing count, each to the least-loaded rank that still has room
                 (`balance`); a rank's load is the pairs routed to its experts in a trace of the model
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moelane.model.checkpoint import ExpertHandle


def share_sizes(n_experts: int, world: int) -> list[int]:
    """How many experts of a layer each rank holds."""
    return [(r + 1) * n_experts // world - r * n_experts // world for r in range(world)]


def balance(loads: Sequence[float], world: int) -> tuple[int, ...]:
    """Each expert's rank: experts by descending load (ties: lower id first), each to the rank with the least load so
    far among those with room left (ties: fewer experts, then lower rank). Greedy, not optimal; a test bounds it
    against the brute-force optimum."""
    room = share_sizes(len(loads), world)
    total, held = [0.0] * world, [0] * world
    owners = [0] * len(loads)
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        r = min((r for r in range(world) if held[r] < room[r]), key=lambda r: (total[r], held[r], r))
        owners[e], total[r], held[r] = r, total[r] + loads[e], held[r] + 1
    return tuple(owners)


@dataclass(frozen=True, slots=True)
class Placement:
    """owners[layer][e]: the rank that holds expert e of MoE layer `layer`. `kind` names how it was chosen; `load`:
    each rank's share of the routed pairs it was balanced by, over every layer (empty for contiguous)."""

    world: int
    owners: dict[int, tuple[int, ...]]
    kind: str = "contiguous"
    load: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for layer, owners in self.owners.items():
            if not 1 <= self.world <= len(owners):
                raise ValueError(f"{self.world} ranks cannot share {len(owners)} experts a layer: at most one rank "
                                 "per expert")  # fmt: skip
            if [owners.count(r) for r in range(self.world)] != share_sizes(len(owners), self.world):
                raise ValueError(f"MoE layer {layer}: each rank must hold as many experts as its contiguous range")

    @classmethod
    def contiguous(cls, layers: Sequence[int], n_experts: int, world: int) -> Placement:
        owners = tuple(r for r, n in enumerate(share_sizes(n_experts, world)) for _ in range(n))
        return cls(world, {layer: owners for layer in layers})

    @classmethod
    def balanced(cls, loads: Mapping[int, Sequence[float]], world: int) -> Placement:
        """Balanced by `loads`: each MoE layer's routing count of each expert."""
        owners = {layer: balance(counts, world) for layer, counts in loads.items()}
        per_rank = [0.0] * world
        for layer, counts in loads.items():
            for e, n in enumerate(counts):
                per_rank[owners[layer][e]] += n
        total = sum(per_rank) or 1.0
        return cls(world, owners, "balanced", tuple(n / total for n in per_rank))

    def experts(self, layer: int, rank: int) -> list[int]:
        """The global ids of the experts of `layer` that `rank` holds, ascending (its local ids 0, 1, ...)."""
        return [e for e, r in enumerate(self.owners[layer]) if r == rank]

    def owner_ids(self, layer: int) -> torch.Tensor:
        """The rank of each expert of `layer`, [E] int64."""
        return torch.tensor(self.owners[layer], dtype=torch.int64)

    def local_ids(self, layer: int) -> torch.Tensor:
        """Each expert of `layer`'s id on its own rank, [E] int64."""
        out = torch.empty(len(self.owners[layer]), dtype=torch.int64)
        for rank in range(self.world):
            ids = self.experts(layer, rank)
            out[ids] = torch.arange(len(ids))
        return out

    def share(self, handles: dict[int, list[ExpertHandle]], rank: int) -> dict[int, list[ExpertHandle]]:
        """The handles of the experts `rank` holds, per layer, in local id order."""
        return {layer: [experts[e] for e in self.experts(layer, rank)] for layer, experts in handles.items()}

    def describe(self) -> str:
        """One line: how the experts are spread."""
        owners = next(iter(self.owners.values()))
        if self.kind == "contiguous":
            bounds = [(owners.index(r), len(owners) - owners[::-1].index(r)) for r in range(self.world)]
            spread = ", ".join(f"rank {r} [{lo}, {hi})" for r, (lo, hi) in enumerate(bounds))
            return f"experts over {self.world} ranks ({spread} of {len(owners)} a layer)"
        counts = share_sizes(len(owners), self.world)
        sizes = ", ".join(f"rank {r} {n} ({share:.1%} of the trace's pairs)"
                          for r, (n, share) in enumerate(zip(counts, self.load, strict=True)))  # fmt: skip
        return f"experts over {self.world} ranks, balanced by routing ({sizes}; of {len(owners)} a layer)"
