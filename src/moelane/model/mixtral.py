"""Mixtral (8x7B, 8x22B): Llama-style GQA without biases; every layer MoE with a softmax top-k router whose top-k
weights are always renormalised; experts named `block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down), the router
`block_sparse_moe.gate` (renamed to `mlp.gate` on load). `sliding_window`, when set, applies to every layer."""

from __future__ import annotations

from typing import Any, TypeVar

from torch import nn

from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, attention_heads, config_get, sliding_windows
from moelane.model.layers import Rope, rope_parameters
from moelane.model.qwen3_moe import SparseMoe

EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts"


T = TypeVar("T")


def sanitize(weights: dict[str, T]) -> dict[str, T]:
    """Checkpoint names -> ours (values untouched: tensors or their disk references)."""
    return {name.replace(".block_sparse_moe.", ".mlp."): w for name, w in weights.items()}


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-5)
    n_heads, n_kv, head_dim = attention_heads(config)
    top_k = config["num_experts_per_tok"]
    n_layers = config["num_hidden_layers"]
    windows = sliding_windows(config, flagged=False)

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, eps=eps, window=windows[i])

    def make_mlp(i: int) -> nn.Module:
        return SparseMoe(hidden, n_experts(config), top_k, norm=True, round_weights=False)

    max_pos = config.get("max_position_embeddings", 32768)
    rope = Rope.build(rope_parameters(config, default_theta=1e6), head_dim, max_pos)  # (transformers' default theta)
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), list(range(n_layers)), (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_local_experts", "num_experts"))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
