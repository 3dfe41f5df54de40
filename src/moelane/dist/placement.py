"""Which rank holds which routed expert: contiguous ranges of expert ids, the same in every MoE layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelane.model.checkpoint import ExpertHandle


@dataclass(frozen=True, slots=True)
class Placement:
    """E experts a layer over W ranks: rank r holds ids [r * E // W, (r + 1) * E // W)."""

    n_experts: int
    world: int

    def __post_init__(self) -> None:
        if not 1 <= self.world <= self.n_experts:
            raise ValueError(f"{self.world} ranks cannot share {self.n_experts} experts a layer: at most one rank "
                             "per expert")  # fmt: skip

    def bounds(self, rank: int) -> tuple[int, int]:
        """The expert ids [lo, hi) rank `rank` holds."""
        return rank * self.n_experts // self.world, (rank + 1) * self.n_experts // self.world

    def owners(self) -> torch.Tensor:
        """The rank of each expert id, [E] int64."""
        return torch.cat([torch.full((hi - lo,), r) for r, (lo, hi) in enumerate(map(self.bounds, range(self.world)))])

    def share(self, handles: dict[int, list[ExpertHandle]], rank: int) -> dict[int, list[ExpertHandle]]:
        """The handles of the experts `rank` holds, per layer: its provider's expert e is expert lo + e."""
        lo, hi = self.bounds(rank)
        return {layer: experts[lo:hi] for layer, experts in handles.items()}
