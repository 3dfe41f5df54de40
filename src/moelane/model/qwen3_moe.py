"""Qwen3-MoE (Qwen3-30B-A3B and kin): GQA with per-head q/k RMSNorm, softmax top-k router, optional renormalisation
(`norm_topk_prob`), dense layers where `mlp_only_layers` / `decoder_sparse_step` say so. No sliding window: the
released checkpoints have none, and a config that sets `use_sliding_window` is refused, since implementations disagree
on which layers it applies to (transformers 5.24 windows every layer and ignores `max_window_layers`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, Routing, attention_heads, config_get, is_moe_layer
from moelane.model.layers import Rope, linear, rope_parameters
from moelane.model.moe import run_experts, softmax_topk
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


class SparseMoe(nn.Module):
    """Routed experts under a softmax top-k router; the weights rounded to the model's dtype (`round_weights`), as
    transformers' Qwen and OLMoE routers give them (Mixtral's stay fp32)."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, norm: bool, round_weights: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.top_k, self.norm, self.round_weights = top_k, norm, round_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = softmax_topk(linear(x, self.gate.weight), self.top_k, self.norm)
        return weights.to(x.dtype) if self.round_weights else weights, ids

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        return run_experts(x, layer, ids, weights, provider)


def build(config: dict[str, Any]) -> Decoder:
    if config.get("use_sliding_window") and config.get("sliding_window"):
        raise ModelLoadError("qwen3_moe with use_sliding_window is not supported (which layers slide is not agreed)")
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
    n_heads, n_kv, head_dim = attention_heads(config)
    n_experts = config_get(config, "num_experts", "num_local_experts")
    top_k = config["num_experts_per_tok"]
    n_layers = config["num_hidden_layers"]
    moe_layers = [i for i in range(n_layers) if is_moe_layer(config, i)]

    def make_attention(i: int) -> nn.Module:
        bias = bool(config.get("attention_bias"))
        return Attention(hidden, n_heads, n_kv, head_dim, bias, "head", eps, o_bias=bias)

    def make_mlp(i: int) -> nn.Module:
        if i in moe_layers:
            return SparseMoe(hidden, n_experts, top_k, bool(config.get("norm_topk_prob")))
        return DenseMlp(hidden, config["intermediate_size"])

    max_pos = config.get("max_position_embeddings", 32768)
    rope = Rope.build(rope_parameters(config), head_dim, max_pos)
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_experts", "num_local_experts"))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
