"""OLMoE (OLMoE-1B-7B): GQA with RMSNorm over the whole q and k projections (not per head), optional `clip_qkv`
clamping of q/k/v, `attention_bias` on all four projections; every layer MoE with a softmax top-k router and optional
renormalisation (`norm_topk_prob`, off in the released checkpoints). Expert width is `intermediate_size`."""

from __future__ import annotations

from typing import Any

from torch import nn

from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, attention_heads, config_get
from moelane.model.layers import Rope, rope_parameters
from moelane.model.qwen3_moe import SparseMoe

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-5)
    n_heads, n_kv, head_dim = attention_heads(config)
    top_k = config["num_experts_per_tok"]
    n_layers = config["num_hidden_layers"]
    bias = bool(config.get("attention_bias"))
    clip = config.get("clip_qkv")

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, "full", eps, o_bias=bias, clip=clip)

    def make_mlp(i: int) -> nn.Module:
        return SparseMoe(hidden, n_experts(config), top_k, bool(config.get("norm_topk_prob")))

    rope = Rope.build(rope_parameters(config), head_dim, config.get("max_position_embeddings", 4096))
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), list(range(n_layers)), (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_experts", "num_local_experts"))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
