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

from dataclasses import dataclass
from typing import Any

import torch

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.checkpoint import ExpertHandle, TensorRef, fused_experts
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import Family
from moelane.model.layers import RMSNormScaledFp32, pointwise
from moelane.model.moe import MoeBlock, Names
from moelane.model.rope import rope_parameters
from moelane.model.routers import TopKSoftmax

# transformers' rope for a config that gives none
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class GptOssConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=131072, low=1)
    rope_theta: float = 150000.0
    n_experts: int = key("num_local_experts", "num_experts", default=0, low=0)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("intermediate_size", default=None, low=1)
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    sliding_window: int | None = key(default=128, keep_null=True, what=WINDOW)  # null: no window
    layer_types: list[str] | None = None

    def check(self) -> None:
        if self.n_experts < 1:
            raise ModelLoadError("gpt_oss needs num_local_experts >= 1 (every layer is MoE)")
        self.windows()

    def windows(self) -> list[int | None]:
        """Per layer, its sliding window (None: full attention), from `layer_types` (default: even layers slide)."""
        n_layers, window = self.num_hidden_layers, self.sliding_window
        types = self.layer_types or [("full_attention", "sliding_attention")[(i + 1) % 2] for i in range(n_layers)]
        if len(types) != n_layers:
            raise ModelLoadError(f"config.json has {len(types)} layer_types for {n_layers} layers")
        if window is not None and window < 1:
            raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
        return [window if t == "sliding_attention" and window else None for t in types]

    def rope_params(self) -> dict[str, Any]:
        given = self.rope_parameters is not None or self.rope_scaling is not None
        keys = dict(rope_parameters=self.rope_parameters if given else DEFAULT_ROPE, rope_scaling=self.rope_scaling,
                    original_max_position_embeddings=self.original_max_position_embeddings)  # fmt: skip
        return rope_parameters(keys, self.rope_theta)


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation over interleaved gate (even) and up (odd) outputs [..., 2I] -> [..., I]."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        alpha, limit = self.alpha, self.limit

        def fn(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            gate = gate.clamp(max=limit)
            return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))

        return pointwise(fn, gate_up[..., ::2].contiguous(), gate_up[..., 1::2].contiguous())


class GptOss(Family[GptOssConfig]):
    config_class = GptOssConfig
    quantized = ("mxfp4",)

    def find_experts(
        self, refs: dict[str, TensorRef], prefix: str, n_experts: int, fp8_block: tuple[int, int] | None
    ) -> list[ExpertHandle] | None:
        return fused_experts(refs, prefix, n_experts)

    def build(self, config: GptOssConfig) -> Decoder:
        c, windows, bias = config, config.windows(), config.attention_bias
        router, act = TopKSoftmax(c.k), ClampedSwiGLU(c.swiglu_alpha, c.swiglu_limit)
        biases = ("experts.gate_up_proj_bias", "experts.down_proj_bias")
        names = Names(gate="router", gate_bias=True, expert_bias=biases)

        def moe() -> MoeBlock:
            return MoeBlock(c.hidden_size, c.n_experts, router, names=names, act=act, expert_width=c.moe_width)

        return Decoder(c, lambda i: Attention.of(c, bias=bias, o_bias=bias, window=windows[i], sinks=True),
                       c.rope(), moe=moe, norm=RMSNormScaledFp32)  # fmt: skip


FAMILY = GptOss()
