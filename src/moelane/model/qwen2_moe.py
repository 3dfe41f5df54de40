"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v bias and no q/k norm; softmax top-k router with
optional renormalisation (`norm_topk_prob`, off in the released checkpoints); one shared expert per MoE layer
(`mlp.shared_expert`) whose output is scaled by a sigmoid gate (`mlp.shared_expert_gate`); dense layers where
`mlp_only_layers` / `decoder_sparse_step` say so. Sliding-window layers follow `layer_types`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, Routing, attention_heads, config_get, is_moe_layer, sliding_windows
from moelane.model.layers import MLP, Rope, linear, pointwise, rope_parameters
from moelane.model.moe import run_experts, softmax_topk
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


class SharedExpertMoe(nn.Module):
    """Routed experts plus one always-on shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, norm: bool, shared_width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.shared_expert = MLP(hidden, shared_width)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.top_k, self.norm = top_k, norm

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(linear(x, self.gate.weight), self.top_k, self.norm)  # [T, K]
        return weights.to(x.dtype), ids  # (rounded to the model's dtype, as transformers' router gives them)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        routed = run_experts(x, layer, ids, weights, provider)
        gate = pointwise(torch.sigmoid, linear(x, self.shared_expert_gate.weight))
        shared: torch.Tensor = gate * self.shared_expert(x)
        return routed + shared


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
    n_heads, n_kv, head_dim = attention_heads(config)
    top_k = config["num_experts_per_tok"]
    n_layers = config["num_hidden_layers"]
    moe_layers = [i for i in range(n_layers) if n_experts(config) > 0 and is_moe_layer(config, i)]
    windows = sliding_windows(config, flagged=True)
    bias = bool(config.get("qkv_bias", True))  # transformers' default; released configs leave it out

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, None, eps, window=windows[i])

    def make_mlp(i: int) -> nn.Module:
        if i in moe_layers:
            norm = bool(config.get("norm_topk_prob"))
            return SharedExpertMoe(hidden, n_experts(config), top_k, norm, config["shared_expert_intermediate_size"])
        return DenseMlp(hidden, config["intermediate_size"])

    rope = Rope.build(rope_parameters(config), head_dim, config.get("max_position_embeddings", 32768))
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_experts", "num_local_experts", default=0))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
