"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`): GQA with q/k/v bias and optional per-head q/k RMSNorm
(`use_qk_norm`), rotary embeddings on the first `partial_rotary_factor` of each head (default 0.5, Llama-style
halves); a sigmoid router whose choice adds a learnt per-expert bias (`e_score_correction_bias`) and is limited to
the `topk_group` best of `n_group` groups (a group's score: its two best experts), while the weights are the
unbiased sigmoid scores, renormalised when `norm_topk_prob` and scaled by `routed_scaling_factor`; one always-on
shared expert MLP of `n_shared_experts * moe_intermediate_size`; dense layers below `first_k_dense_replace`.

The router's weight and bias stay in fp32 whatever the model's dtype, as the reference keeps them (`KEEP_FP32`):
the bias shifts which experts are chosen, and bf16 would move near-ties. The checkpoints' multi-token-prediction
layer (`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers`) is not used for decoding and is skipped
(`ignored`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.decoder import Decoder, DenseMlp, Routing, config_get
from moelane.model.layers import MLP, Attention, Rope, linear, pointwise, rope_parameters
from moelane.model.moe import run_experts
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
KEEP_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def ignored(config: dict[str, Any], name: str) -> bool:
    """Checkpoint tensors of layers past the decoder's: the multi-token-prediction layers."""
    match = LAYER.match(name)
    return match is not None and int(match.group(1)) >= int(config["num_hidden_layers"])


class Router(nn.Module):
    def __init__(self, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(n_experts))


def biased_group_topk(
    scores: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores [T, E] -> (weights, ids) [T, K]: the k experts of best `scores + bias` within the `topk_group`
    groups whose two best biased scores sum highest; weights are the scores themselves, without the bias."""
    choice = scores + bias
    if n_group > 1:
        n_tokens, n_experts = choice.shape
        per_group = choice.view(n_tokens, n_group, n_experts // n_group)
        best = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, torch.topk(best, topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(n_experts // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices
    return scores.gather(1, ids), ids


class Glm4Moe(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, width = config["hidden_size"], config["moe_intermediate_size"]
        self.gate = Router(hidden, n_experts(config))
        n_shared = int(config.get("n_shared_experts", 1) or 0)
        self.shared_experts = MLP(hidden, n_shared * width) if n_shared else None
        self.top_k = config["num_experts_per_tok"]
        self.n_group, self.topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
        self.norm = bool(config.get("norm_topk_prob", True))
        self.scaling = float(config.get("routed_scaling_factor") or 1.0)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        logits = linear(x.float(), self.gate.weight.float())  # [T, E], in fp32 like the reference
        scores = pointwise(torch.sigmoid, logits)
        weights, ids = biased_group_topk(
            scores, self.gate.e_score_correction_bias.float(), self.top_k, self.n_group, self.topk_group
        )
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        routing.append((ids, weights))
        out = run_experts(x, layer, ids, weights, provider)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def check(config: dict[str, Any], head_dim: int, rotary_dim: int) -> None:
    experts, top_k = n_experts(config), config["num_experts_per_tok"]
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    if n_group > 1 and (experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group):
        raise ModelLoadError(
            f"group routing needs n_group dividing the {experts} experts into groups of 2 or more and "
            f"1 <= topk_group <= n_group, got n_group={n_group}, topk_group={topk_group}"
        )
    if n_group > 1 and top_k > topk_group * (experts // n_group):
        raise ModelLoadError(f"num_experts_per_tok {top_k} exceeds the experts of the {topk_group} groups kept")
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor gives {rotary_dim} rotary dims of a head's {head_dim}; "
                             "they must be an even number from 2 to the head's")  # fmt: skip


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-5)
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or hidden // n_heads
    params = rope_parameters(config)
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    rotary_dim = int(head_dim * float(factor if factor is not None else 0.5))
    check(config, head_dim, rotary_dim)
    n_layers = config["num_hidden_layers"]
    first_dense = int(config.get("first_k_dense_replace", 1) or 0)
    moe_layers = [i for i in range(n_layers) if n_experts(config) > 0 and i >= first_dense]
    bias, qk_norm = bool(config.get("attention_bias")), "head" if config.get("use_qk_norm") else None

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, qk_norm, eps, rotary_dim=rotary_dim)

    def make_mlp(i: int) -> nn.Module:
        return Glm4Moe(config) if i in moe_layers else DenseMlp(hidden, config["intermediate_size"])

    rope = Rope.build(params, rotary_dim, config.get("max_position_embeddings", 131072))
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "n_routed_experts", "num_local_experts", default=0))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
