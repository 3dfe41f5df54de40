"""Routers: which experts each token goes to, and with what weights.

A router is a small frozen object (its k, its normalisation, the precision of its logits) called with the rows x
[T, H] and the MoE block's `Gate` tensors; it returns (weights, ids) [T, K]. Being a function of its inputs alone, the
same choice can be made away from its block: the pager's look-ahead applies a later block's `route` to an earlier
layer's input.

`Precision` says where a reference computes the logits, which decides their last bits in bf16: "model", in the
compute dtype; "scores", the same product rounded up to fp32 for everything after it; "fp32", x and the weight in
fp32 before the product. In fp32 the three are the same numbers.

The routers most families share live here (softmax then top-k, top-k then softmax, sigmoid with a score bias and
group limits); a router only one family has (DeepSeek-V2's group-limited softmax, ERNIE's, Phi-MoE's sparsemixer,
Llama 4's) lives in that family's file.

Shape alphabet: T tokens, H hidden, E experts, K top-k, G expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch

from moelane.errors import ModelLoadError
from moelane.model.layers import linear, pointwise

Precision = Literal["model", "scores", "fp32"]


class Gate(NamedTuple):
    """A MoE block's router tensors."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor | None = None  # [E], added to the logits (gpt-oss)
    score_bias: torch.Tensor | None = None  # [E] ([1, E]: ERNIE), added to the scores when choosing, not weighing


class Router(Protocol):
    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [T, H] -> (weights, ids) [T, K]."""
        ...


def router_logits(x: torch.Tensor, gate: Gate, precision: Precision) -> torch.Tensor:
    """x [T, H] -> logits [T, E] in `precision`."""
    if precision == "fp32":
        return linear(x.float(), gate.weight.float(), None if gate.bias is None else gate.bias.float())
    logits = linear(x, gate.weight, gate.bias)
    return logits.float() if precision == "scores" else logits


def softmax_topk(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k; renormalise them to sum 1 when `norm`. -> (weights, ids) [T, K]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k logits, softmaxed over those k alone (in the logits' dtype) -> (weights, ids) [T, K]."""
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def biased_group_topk(
    scores: torch.Tensor, bias: torch.Tensor | None, k: int, n_group: int = 1, topk_group: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [T, E] -> (weights, ids) [T, K]: the k experts of best `scores + bias` within the `topk_group` groups
    whose two best biased scores sum highest; weights are the scores themselves, without the bias."""
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        n_tokens, n_experts = choice.shape
        per_group = choice.view(n_tokens, n_group, n_experts // n_group)
        best = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, torch.topk(best, topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(n_experts // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices
    return scores.gather(1, ids), ids


@dataclass(frozen=True, slots=True)
class SoftmaxTopK:
    """Softmax over all experts, the top k kept, renormalised to sum 1 when `norm` (Qwen, OLMoE, Mixtral, Hunyuan);
    the weights rounded to the model's dtype when `round_weights`, as transformers' Qwen and OLMoE routers give them
    (Mixtral's stay fp32)."""

    k: int
    norm: bool
    precision: Precision = "model"
    round_weights: bool = False

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(router_logits(x, gate, self.precision), self.k, self.norm)
        return (weights.to(x.dtype) if self.round_weights else weights), ids


@dataclass(frozen=True, slots=True)
class TopKSoftmax:
    """The top k logits, softmaxed over those k alone (gpt-oss, Granite); the weights rounded to the model's dtype
    when `round_weights`."""

    k: int
    precision: Precision = "model"
    round_weights: bool = False

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = topk_softmax(router_logits(x, gate, self.precision), self.k)
        return (weights.to(x.dtype) if self.round_weights else weights), ids


@dataclass(frozen=True, slots=True)
class SigmoidTopK:
    """Sigmoid scores choose by `biased_group_topk` (the gate's score bias added, within `topk_group` of `n_group`
    groups); the unbiased scores weigh, renormalised to sum 1 (`eps` added to the sum) when `norm`, then times
    `scaling`. DeepSeek-V3's "noaux_tc" (also GLM-4.5, dots.llm1, K-EXAONE), MiniMax-M2's and LFM2's routing."""

    k: int
    norm: bool = True
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    eps: float = 1e-20
    precision: Precision = "fp32"

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        scores = pointwise(torch.sigmoid, router_logits(x, gate, self.precision))
        weights, ids = biased_group_topk(scores, gate.score_bias, self.k, self.n_group, self.topk_group)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.eps)
        return weights * self.scaling, ids


def check_groups(n_experts: int, k: int, n_group: int, topk_group: int) -> None:
    """The group limits `biased_group_topk` can apply, or a ModelLoadError naming them."""
    if n_group > 1 and (n_experts % n_group or n_experts // n_group < 2 or not 1 <= topk_group <= n_group):
        raise ModelLoadError(
            f"group routing needs n_group dividing the {n_experts} experts into groups of 2 or more and "
            f"1 <= topk_group <= n_group, got n_group={n_group}, topk_group={topk_group}"
        )
    if n_group > 1 and k > topk_group * (n_experts // n_group):
        raise ModelLoadError(f"num_experts_per_tok {k} exceeds the experts of the {topk_group} groups kept")
