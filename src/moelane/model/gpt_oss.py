"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA with q/k/v/o biases and a learnt sink logit per query head in every
softmax (`attention.with_sinks`); layers alternate sliding-window and full attention (`layer_types`; the default:
even layers slide); YaRN rotary embeddings. Every layer is MoE: a linear router with a bias, whose top-k logits are
softmaxed into the weights; experts with biases and a clamped SwiGLU, `(clamp(up) + 1) * g * sigmoid(alpha * g)`
with `g = clamp(gate, max=limit)`, over interleaved gate/up outputs. RMSNorm applies its weight in fp32.

Checkpoints keep each layer's experts fused, `mlp.experts.gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]
(layout "transposed"), or, as released, in MXFP4 (`*_blocks`, `*_scales`, with `quantization_config.quant_method`
"mxfp4"; layout "mxfp4", expanded to the compute dtype as an expert is loaded, so the pager stores and pages the
4-bit form). The experts' biases are small dense tensors of the block, read at load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.checkpoint import ExpertHandle, TensorRef, stacked_experts
from moelane.model.decoder import Decoder, Routing, attention_heads, config_get
from moelane.model.layers import RMSNormScaledFp32, Rope, linear, pointwise, rope_parameters
from moelane.model.moe import run_experts, topk_softmax
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate_up": "gate_up_proj", "down": "down_proj"}
MXFP4_NAMES = {"gate_up_blocks": "gate_up_proj_blocks", "gate_up_scales": "gate_up_proj_scales",
               "down_blocks": "down_proj_blocks", "down_scales": "down_proj_scales"}  # fmt: skip
QUANTIZED = ("mxfp4",)
# transformers' rope for a config that gives none
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)  # fmt: skip


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def find_experts(refs: dict[str, TensorRef], prefix: str, n_experts: int) -> list[ExpertHandle] | None:
    """The layer's experts, as released in MXFP4 ("mxfp4") or fused as saved by transformers ("transposed"). (Also
    Llama 4's, fused in the same layout, whose prefix may start with its release's `language_model.`)"""
    mxfp4 = stacked_experts(refs, prefix, MXFP4_NAMES, n_experts, "mxfp4")
    return mxfp4 or stacked_experts(refs, prefix, EXPERT_NAMES, n_experts, "transposed")


class Experts(nn.Module):
    """The experts' biases (their weights live in the provider's pools), under the checkpoints' names."""

    def __init__(self, hidden: int, width: int, n_experts: int) -> None:
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(n_experts, 2 * width))
        self.down_proj_bias = nn.Parameter(torch.zeros(n_experts, hidden))


class GptOssMoe(nn.Module):
    def __init__(self, hidden: int, width: int, n_experts: int, top_k: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, n_experts, bias=True)
        self.experts = Experts(hidden, width, n_experts)
        self.top_k, self.alpha, self.limit = top_k, alpha, limit

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU over interleaved gate (even) and up (odd) outputs [..., 2I] -> [..., I]."""
        alpha, limit = self.alpha, self.limit

        def fn(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            gate = gate.clamp(max=limit)
            return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))

        return pointwise(fn, gate_up[..., ::2].contiguous(), gate_up[..., 1::2].contiguous())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_softmax(linear(x, self.router.weight, self.router.bias), self.top_k)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        bias = (self.experts.gate_up_proj_bias, self.experts.down_proj_bias)
        return run_experts(x, layer, ids, weights, provider, self.act, bias)


def windows(config: dict[str, Any]) -> list[int | None]:
    """Per layer, its sliding window (None: full attention), from `layer_types` (default: even layers slide) and
    `sliding_window` (default 128, as transformers' GptOssConfig)."""
    n_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window", 128)
    types = config.get("layer_types") or [("full_attention", "sliding_attention")[(i + 1) % 2] for i in range(n_layers)]
    if len(types) != n_layers:
        raise ModelLoadError(f"config.json has {len(types)} layer_types for {n_layers} layers")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
    return [window if t == "sliding_attention" and window else None for t in types]


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-5)
    n_heads, n_kv, head_dim = attention_heads(config)
    width, top_k = expert_width(config), config["num_experts_per_tok"]
    n_layers = config["num_hidden_layers"]
    if n_experts(config) < 1:
        raise ModelLoadError("gpt_oss needs num_local_experts >= 1 (every layer is MoE)")
    per_layer = windows(config)
    bias = bool(config.get("attention_bias", True))
    alpha, limit = float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, eps=eps, o_bias=bias, window=per_layer[i], sinks=True)

    def make_mlp(i: int) -> nn.Module:
        return GptOssMoe(hidden, width, n_experts(config), top_k, alpha, limit)

    given = any(isinstance(config.get(key), dict) for key in ("rope_parameters", "rope_scaling"))
    params = rope_parameters(config if given else {**config, "rope_parameters": DEFAULT_ROPE}, default_theta=150000.0)
    rope = Rope.build(params, head_dim, config.get("max_position_embeddings", 131072))
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), list(range(n_layers)), (n_kv, head_dim, head_dim), RMSNormScaledFp32,
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_local_experts", "num_experts", default=0))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
