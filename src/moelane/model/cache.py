"""Per-stream KV cache: one static buffer per attention layer, written at absolute positions.

The buffer's capacity is fixed when the stream starts, so every attention call of a stream reduces over the same
length (batch invariance) and a compiled step sees fixed shapes. A stream's length lives with its owner, not here:
rolling back rejected drafts is just feeding the next rows at an earlier position; stale entries past a row's
position are masked by attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    def __init__(
        self, shapes: dict[int, tuple[int, int, int]], capacity: int, dtype: torch.dtype, device: str = "cpu"
    ) -> None:
        """shapes: per attention layer, (kv heads, key dim, value dim)."""
        self.capacity = capacity
        self.k = {i: torch.zeros(h, capacity, dk, dtype=dtype, device=device) for i, (h, dk, _) in shapes.items()}
        self.v = {i: torch.zeros(h, capacity, dv, dtype=dtype, device=device) for i, (h, _, dv) in shapes.items()}
        self._dynamic = False

    def mark_dynamic(self) -> None:
        """Let a compiled step take this cache's capacity as a symbol: one graph serves every capacity."""
        if not self._dynamic:
            for t in (*self.k.values(), *self.v.values()):
                torch._dynamo.mark_dynamic(t, 1)
            self._dynamic = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [n, Hkv, D] at `positions` [n]; return the layer's whole buffers [Hkv, C, D]."""
        kc, vc = self.k[layer], self.v[layer]
        if k.dtype != kc.dtype:
            k, v = k.to(kc.dtype), v.to(vc.dtype)
        kc.index_copy_(1, positions, k.transpose(0, 1))
        vc.index_copy_(1, positions, v.transpose(0, 1))
        return kc, vc


@dataclass(frozen=True, slots=True)
class Rows:
    """One stream's part of a forward pass: `token_ids` fed at positions start, start+1, ..."""

    cache: KVCache
    token_ids: list[int]
    start: int
    stream_id: int = 0
    # A generated token fed to read the next one (one row, prompt all fed): a compiled model runs it through its
    # compiled decode step, as `LM.step` does, so the row has the same bits in a shared round as in a decode alone.
    decode: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("Rows needs at least one token")
        if self.start < 0 or self.start + len(self.token_ids) > self.cache.capacity:
            raise ValueError(
                f"rows at positions {self.start}..{self.start + len(self.token_ids) - 1} "
                f"do not fit a cache of {self.cache.capacity}"
            )
        if self.decode and len(self.token_ids) != 1:
            raise ValueError(f"decode rows are one token, got {len(self.token_ids)}")
