"""Token choice as a pure function of (logits, settings, seed, absolute position, reply so far).

The logits are first adjusted as the request asks (OpenAI's `logit_bias`, `presence_penalty`, `frequency_penalty`;
the penalties count the tokens of the reply so far, not the prompt; a `grammar` masks what may not follow the reply
so far), then greedy (temperature 0, or below `GREEDY_BELOW`) takes the argmax (the lowest id on ties). Sampling
is Gumbel-max: the noise for a position comes from a generator keyed by (seed, position), so the token chosen at
position p is the same whether p is decoded alone, as a drafted row in a verify round, or in a batch with other
streams. That is what lets the lanes engine verify drafts of sampled requests exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moelane.model.grammar import Grammar

MASK63 = (1 << 63) - 1
# Temperatures below this choose greedily (as vLLM's): logits divided by 1e-38 overflow float32, and every token
# then ties at infinity; well before that, the sample is the argmax but for exact ties.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the caller picks one per request
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    presence_penalty: float = 0.0  # subtracted from the logit of each token the reply already holds
    frequency_penalty: float = 0.0  # subtracted once for each time the reply already holds the token
    grammar: Grammar | None = field(default=None, compare=False)  # tokens outside what it allows are never chosen

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            if isinstance(value := getattr(self, name), bool) or not isinstance(value, Real):  # ("0.5" too)
                raise ValueError(f"{name} must be a number, got {value!r}")
        if any(isinstance(b, bool) or not isinstance(b, Real) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be numbers")
        if not 0 <= self.temperature < math.inf:  # (inf would sample every token alike: noise)
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        ids = [i for i, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
            raise ValueError("logit_bias needs distinct non-negative token ids")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError if a logit bias names a token id past the vocabulary, or the grammar is another's."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise ValueError(f"logit_bias token id {token} is out of range for a vocabulary of {vocab_size}")
        if self.grammar is not None and self.grammar.vocab_size != vocab_size:
            raise ValueError(f"the grammar is for a vocabulary of {self.grammar.vocab_size}, not {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before the choice (and the choice depends on the reply so far)."""
        return (bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.grammar is not None)  # fmt: skip


def noise_key(seed: int, position: int) -> int:
    """Mix seed and position into one generator seed (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & MASK63


def adjusted(logits: torch.Tensor, params: SamplingParams, reply: Sequence[int]) -> torch.Tensor:
    """The logits [V] after the request's bias and penalties (the same tensor when it asks for none)."""
    if not params.adjusts:
        return logits
    z = logits.float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        z[list(ids)] += torch.tensor(bias)
    if reply and (params.presence_penalty or params.frequency_penalty):
        ids_t, counts = torch.unique(torch.tensor(list(reply)), return_counts=True)
        z[ids_t] -= params.presence_penalty + params.frequency_penalty * counts.float()
    if params.grammar is not None:
        z.masked_fill_(~params.grammar.allowed(reply), float("-inf"))
    return z


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


def argmax(logits: torch.Tensor) -> int:
    """The index of the largest of the logits [V]: the lowest on ties, a NaN's where there is one (torch.argmax's
    answer). On the CPU through NumPy: torch's took ~46 us for 32k float32 logits here, NumPy's ~2.5 us, and greedy
    decode pays it every token."""
    if _numpy_reads(logits):
        return int(logits.detach().numpy().argmax())
    return int(torch.argmax(logits))


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """`argmax` of each row of logits [N, V]."""
    ids: list[int] = (logits.detach().numpy() if _numpy_reads(logits) else logits).argmax(-1).tolist()
    return ids


def _numpy_reads(logits: torch.Tensor) -> bool:
    """Whether NumPy can take the logits as they are (CPU memory, a dtype it has)."""
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)


def sample(logits: torch.Tensor, params: SamplingParams, position: int, reply: Sequence[int] = ()) -> int:
    """The token at absolute `position` given the logits [V] that predict it and the reply before it."""
    logits = adjusted(logits, params, reply)
    if params.greedy:
        return argmax(logits)
    if params.seed is None:
        raise ValueError("sampling needs a seed (pick one per request)")
    gen = torch.Generator().manual_seed(noise_key(params.seed, position))
    u = torch.rand(logits.shape[-1], generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    gumbel = -torch.log(-torch.log(u))
    return argmax(filtered_logits(logits, params).double() + gumbel)
