"""Token choice as a pure function of (logits, settings, seed, absolute position).

Greedy takes the argmax (the lowest id on ties). Sampling is Gumbel-max: the noise for a position comes from a
generator keyed by (seed, position), so the token chosen at position p is the same whether p is decoded alone, as a
drafted row in a verify round, or in a batch with other streams. That is what lets the lanes engine verify drafts of
sampled requests exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the caller picks one per request

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def noise_key(seed: int, position: int) -> int:
    """Mix seed and position into one generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & MASK63


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled float32 logits with everything outside top-k / top-p set to -inf."""
    z = logits.float() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, descending=True, stable=True)
        probs = torch.softmax(sorted_z, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop = before >= params.top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return z


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token at absolute `position` given the logits [V] that predict it."""
    if params.greedy:
        return int(torch.argmax(logits))
    if params.seed is None:
        raise ValueError("sampling needs a seed (pick one per request)")
    gen = torch.Generator().manual_seed(noise_key(params.seed, position))
    u = torch.rand(logits.shape[-1], generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return int(torch.argmax(filtered_logits(logits, params).double() + gumbel))
