"""Llama (2, 3, 3.1, 3.2) and other dense Llama-shaped models: GQA, `attention_bias` on q/k/v/o, `mlp_bias`,
Llama 3.1 rope scaling; no sliding window (transformers ignores `sliding_window` for Llama). No experts: `moe_layers`
is empty and `n_experts` is 0. Also the dense builder qwen3 uses."""

from __future__ import annotations

from typing import Any

from torch import nn

from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, attention_heads, sliding_windows
from moelane.model.layers import Rope, rope_parameters

EXPERT_NAMES: dict[str, str] = {}  # dense: no experts


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"  # never looked up: there are no MoE layers


def build(config: dict[str, Any]) -> Decoder:
    return build_dense(config, qk_norm=None, sliding=False)


def build_dense(config: dict[str, Any], qk_norm: str | None, sliding: bool) -> Decoder:
    """A dense decoder: attention (optionally with per-head q/k norm) and a SwiGLU MLP in every layer; `sliding`:
    Qwen's sliding-window layers (`sliding_windows`), where Llama has none whatever `sliding_window` says."""
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers = config["num_hidden_layers"]
    bias, mlp_bias = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
    windows = sliding_windows(config, flagged=True) if sliding else [None] * n_layers

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, qk_norm, eps, o_bias=bias, window=windows[i])

    def make_mlp(i: int) -> nn.Module:
        return DenseMlp(hidden, config["intermediate_size"], mlp_bias)

    rope = Rope.build(rope_parameters(config), head_dim, config.get("max_position_embeddings", 2048))
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), [], (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return 0


def expert_width(config: dict[str, Any]) -> int:
    return 0
