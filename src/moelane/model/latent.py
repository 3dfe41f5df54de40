"""DeepSeek's multi-head latent attention (MLA), which DeepSeek-V2, DeepSeek-V3 and GLM-4.7-Flash share, with the
config keys it reads.

q comes straight from `q_proj` or through a low-rank bottleneck (`q_a_proj`, RMSNorm, `q_b_proj`) when `q_lora_rank`
is set; keys and values are decompressed from one `kv_lora_rank` latent (`kv_a_proj_with_mqa`, RMSNorm, `kv_b_proj`)
plus a single rotary key part shared by all heads. Each head's query/key is `qk_nope_head_dim` plain dims followed by
`qk_rope_head_dim` rotary dims; values are `v_head_dim` wide. Rotary dims turn in interleaved pairs (or, where a
config says, in halves), in fp32 (DeepSeek-V2's reference) or the model's dtype. The cache holds the decompressed
per-head keys and values (simple, not memory-lean: MLA could cache the latent instead). Yarn scaling with
`mscale_all_dim` also scales the softmax by mscale^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Batch, attend_streams
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder, DenseMlp, Make, dense_width
from moelane.model.layers import RMSNorm, linear
from moelane.model.rope import Rope, rotate_halves, rotate_pairs


@dataclass(frozen=True, slots=True, kw_only=True)
class LatentConfig(Config):
    """The keys of MLA, with DeepSeek's defaults. A config without `q_lora_rank` gets transformers' default, so a
    checkpoint that does not match it is refused (missing tensors, other shapes) instead of loading with its low-rank
    q ignored; an explicit null means none, as in DeepSeek's code."""

    qk_nope_head_dim: int = key(low=1)
    qk_rope_head_dim: int = key(low=2)
    v_head_dim: int = key(low=1)
    kv_lora_rank: int = key(low=1)
    q_lora_rank: int | None = key(default=1536, keep_null=True, low=1)
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = key(default=4096, low=1)

    def check(self) -> None:
        check_latent(self)


def check_latent(config: LatentConfig) -> None:
    """What the latent attention needs of a config (a family's `check` calls it)."""
    if config.n_kv_heads != config.num_attention_heads:
        raise ModelLoadError(f"MLA needs num_key_value_heads == num_attention_heads, got {config.n_kv_heads}")


class LatentAttention(nn.Module):
    """MLA. `rope_dtype`: the dtype rotary embeddings are computed in (None: the model's); `interleave`: rotary dims
    in interleaved pairs or in halves."""

    def __init__(self, config: LatentConfig, rope: Rope, rope_dtype: torch.dtype | None, interleave: bool) -> None:
        super().__init__()
        self.rope_dtype, self.rotate = rope_dtype, rotate_pairs if interleave else rotate_halves
        hidden, n_heads = config.hidden_size, config.num_attention_heads
        self.n_heads = n_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank, self.q_rank = config.kv_lora_rank, config.q_lora_rank
        qk_dim, bias = self.nope + self.rope_dim, config.attention_bias
        if self.q_rank is None:
            self.q_proj = nn.Linear(hidden, n_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_rank, 1e-6)  # the reference leaves these two at the default eps
            self.q_b_proj = nn.Linear(self.q_rank, n_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(n_heads * self.v_dim, hidden, bias=bias)
        self.rope = rope
        self.scale = qk_dim**-0.5 * softmax_mscale(config.rope_params()) ** 2

    def forward(
        self, x: torch.Tensor, layer: int, batch: Batch, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n, h = x.shape[0], self.n_heads
        if self.q_rank is None:
            q = linear(x, self.q_proj.weight)
        else:
            q = linear(self.q_a_layernorm(linear(x, self.q_a_proj.weight, self.q_a_proj.bias)), self.q_b_proj.weight)
        q_nope, q_pe = torch.split(q.view(n, h, -1), [self.nope, self.rope_dim], dim=-1)
        compressed = linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        latent, k_pe = torch.split(compressed, [self.kv_rank, self.rope_dim], dim=-1)
        kv = linear(self.kv_a_layernorm(latent), self.kv_b_proj.weight).view(n, h, -1)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        cos, sin = self.rope.cos_sin(batch.positions, self.rope_dtype or x.dtype)  # as the reference, not `rope`
        q_pe, k_pe = self.rotate(q_pe, cos, sin), self.rotate(k_pe.view(n, 1, -1), cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(n, h, -1)], dim=-1)
        out = attend_streams(q, k, v, layer, batch, self.scale)
        return linear(out.reshape(n, -1), self.o_proj.weight, self.o_proj.bias)


def softmax_mscale(params: dict[str, Any]) -> float:
    """Yarn with `mscale_all_dim`: the extra softmax scale is this squared (1.0 otherwise)."""
    all_dim = params.get("mscale_all_dim")
    factor = float(params.get("factor") or 1.0)
    if params.get("rope_type", "default") == "default" or not all_dim or factor <= 1:
        return 1.0
    return 0.1 * float(all_dim) * math.log(factor) + 1.0


def latent_decoder(config: LatentConfig, moe: Make, rope_dtype: torch.dtype | None, interleave: bool) -> Decoder:
    """A DeepSeek decoder: MLA in every layer, `moe()` in the config's MoE layers, dense MLPs (with `mlp_bias`)
    elsewhere."""
    rope = Rope.build(config.rope_params(), config.qk_rope_head_dim, config.max_position_embeddings)
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return Decoder(
        config, lambda i: LatentAttention(config, rope, rope_dtype, interleave), rope, moe=moe,
        dense=lambda: DenseMlp(config.hidden_size, dense_width(config), config.mlp_bias),
        cache_shape=(config.num_attention_heads, qk_dim, config.v_head_dim),
    )  # fmt: skip


def deepseek_moe_layers(n_layers: int, n_experts: int, first_dense: int, freq: int) -> list[int]:
    """DeepSeek's MoE layers: none without experts; else the layers from `first_k_dense_replace` on, every
    `moe_layer_freq`-th."""
    return [i for i in range(n_layers) if n_experts > 0 and i >= first_dense and i % freq == 0]
