"""LFM2-MoE (LFM2-8B-A1B): a hybrid of short gated convolutions and GQA attention layers (`layer_types`: "conv" or
"full_attention"), dense feed-forward layers below `num_dense_layers`, then MoE layers with a sigmoid router whose
choice adds a per-expert bias (`expert_bias`, when `use_expert_bias`), weights renormalised (`norm_topk_prob`) and
scaled (`routed_scaling_factor`), all in the model's dtype. Attention has per-head q/k RMSNorm and no biases.

A conv layer computes `B, C, x = in_proj(h)`, a depthwise causal convolution of `B * x` over the last
`conv_L_cache` positions (summed in fp32 and rounded once, as `F.conv1d` in the reference), then
`out_proj(C * conv)`. Its "cache" is the history of `B * x` by absolute position, kept
in the stream's KV cache like keys (`ShortConv`): a row reads the positions before it by number, so chunked
prefill, shared rounds and rolled-back drafts need nothing of their own (a recurrent state would have to be
restored). It costs a hidden vector per position and conv layer, about what a KV cache of the same model costs.

Checkpoint names are renamed to the shared decoder's (`sanitize`): `operator_norm` / `ffn_norm` are the two layer
norms, `feed_forward` the MLP, a layer's `conv` (or `self_attn`) its mixer, `embedding_norm` the final norm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention, Batch, PoolPart, row_slots
from moelane.model.checkpoint import renamed
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import W1_W3_W2, Family
from moelane.model.layers import linear
from moelane.model.moe import MoeBlock, Names
from moelane.model.routers import SigmoidTopK

T = TypeVar("T")
RENAMES = [
    (re.compile(r"^(model\.layers\.\d+)\.conv\."), r"\1.self_attn."),
    (re.compile(r"\.operator_norm\."), ".input_layernorm."),
    (re.compile(r"\.ffn_norm\."), ".post_attention_layernorm."),
    (re.compile(r"\.feed_forward\."), ".mlp."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.q_layernorm\."), ".q_norm."),
    (re.compile(r"\.k_layernorm\."), ".k_norm."),
    (re.compile(r"\.mlp\.w1\."), ".mlp.gate_proj."),
    (re.compile(r"\.mlp\.w3\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.w2\."), ".mlp.down_proj."),
    (re.compile(r"^model\.embedding_norm\."), "model.norm."),
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Lfm2MoeConfig(Config):
    rms_norm_eps: float = key("norm_eps", default=1e-5, low=0)
    max_position_embeddings: int = key(default=128000, low=1)
    tie_word_embeddings: bool = key("tie_word_embeddings", "tie_embedding", default=True)
    rope_theta: float = 1e6
    n_experts: int = key("num_experts", "num_local_experts", low=1)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    use_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_dense_layers: int = key(default=2, low=0)
    conv_L_cache: int = key(default=3, low=1)
    conv_bias: bool = False
    layer_types: list[str] | None = None
    full_attn_idxs: list[int] | None = None  # (LFM2's older spelling of layer_types)

    def check(self) -> None:
        self.kinds()

    def moe_layers(self) -> list[int]:
        return list(range(self.num_dense_layers, self.num_hidden_layers))

    def kinds(self) -> list[str]:
        n_layers, types = self.num_hidden_layers, self.layer_types
        if types is None and self.full_attn_idxs is not None:
            types = ["full_attention" if i in self.full_attn_idxs else "conv" for i in range(n_layers)]
        if types is None or len(types) != n_layers:
            raise ModelLoadError(f"lfm2_moe needs layer_types, one per layer ({n_layers}), got {types!r}")
        unknown = sorted(set(types) - {"conv", "full_attention"})
        if unknown:
            raise ModelLoadError(f"unknown layer_types {unknown} (lfm2_moe has conv and full_attention layers)")
        return types


class ShortConv(nn.Module):
    """The gated short convolution, in the place of a layer's attention (`self_attn`, called as attention is)."""

    def __init__(self, hidden: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias)  # weight [H, 1, L]
        self.o_proj = nn.Linear(hidden, hidden, bias=bias)
        self.kernel = kernel

    def forward(
        self, x: torch.Tensor, layer: int, batch: Batch, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        b, c, h = linear(x, self.in_proj.weight, self.in_proj.bias).chunk(3, dim=-1)
        history = remember(b * h, layer, batch, self.kernel)  # [N, L, H]: positions p-L+1 .. p of each row
        weight = self.conv.weight[:, 0, :].float()  # [H, L]
        conv = history[:, 0].float() * weight[:, 0]
        for j in range(1, self.kernel):
            conv = conv + history[:, j].float() * weight[:, j]
        if self.conv.bias is not None:
            conv = conv + self.conv.bias.float()
        return linear(c * conv.to(c.dtype), self.o_proj.weight, self.o_proj.bias)


def remember(bx: torch.Tensor, layer: int, batch: Batch, kernel: int) -> torch.Tensor:
    """Write each row's input bx [N, H] into its stream's cache at its position (the layer's "keys"), then read,
    for each row, the inputs at the `kernel` positions ending at its own: [N, kernel, H], zeros before position 0.
    Rows of one stream see each other's inputs, since every write comes first."""
    back = torch.arange(kernel - 1, -1, -1, device=batch.positions.device)
    at = batch.positions[:, None] - back[None, :]  # [N, L]: p - (L-1) .. p
    if batch.parts and batch.slots is not None:  # the compiled decode step: each pool's rows apart, in row order

        def pooled(part: PoolPart, *rows: torch.Tensor) -> torch.Tensor:
            return recall(part.pool.k[layer], *rows)

        return batch.per_part(pooled, batch.slots, batch.positions, at, bx)
    slots = batch.slots if batch.slots is not None else row_slots(batch.caches, batch.spans)
    pools = {cache.pool for cache in batch.caches}
    if len(pools) == 1:
        return recall(pools.pop().k[layer], slots, batch.positions, at, bx)
    out = bx.new_empty(bx.shape[0], kernel, bx.shape[1])
    spans = list(zip(batch.caches, batch.spans, strict=True))
    for pool in pools:
        rows = torch.cat([torch.arange(first, first + n) for cache, (first, n) in spans if cache.pool is pool])
        out[rows] = recall(pool.k[layer], slots[rows], batch.positions[rows], at[rows], bx[rows])
    return out


def recall(
    keys: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, at: torch.Tensor, bx: torch.Tensor
) -> torch.Tensor:
    """Rows of one pool: bx [n, H] written at (slots, positions) of keys [S, 1, C, H], then read at `at` [n, L]."""
    keys[slots, 0, positions] = bx.to(keys.dtype)
    got = keys[slots[:, None], 0, at.clamp(min=0)]  # [n, L, H]
    return torch.where((at >= 0)[..., None], got, torch.zeros((), dtype=got.dtype, device=got.device)).to(bx.dtype)


class LfmDecoder(Decoder):
    """The shared decoder with a cache shape per layer: conv layers keep one hidden vector per position."""

    def __init__(self, config: Lfm2MoeConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._conv_layers = [i for i, kind in enumerate(config.kinds()) if kind == "conv"]
        self._hidden = config.hidden_size

    def cache_shapes(self) -> dict[int, tuple[int, int, int]]:
        shapes = super().cache_shapes()
        return {i: (1, self._hidden, 1) if i in self._conv_layers else shape for i, shape in shapes.items()}


class Lfm2Moe(Family[Lfm2MoeConfig]):
    config_class = Lfm2MoeConfig
    expert_names = W1_W3_W2
    keep_fp32 = ("mlp.expert_bias",)  # (as transformers keeps it: it decides near-ties between experts)

    def expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.feed_forward.experts"

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        return renamed(weights, RENAMES)

    def build(self, config: Lfm2MoeConfig) -> Decoder:
        c, kinds = config, config.kinds()
        router = SigmoidTopK(c.k, c.norm_topk_prob, c.routed_scaling_factor, eps=1e-6, precision="model")
        names = Names(score_bias="expert_bias" if c.use_expert_bias else None)

        def attention(i: int) -> nn.Module:
            if kinds[i] == "conv":
                return ShortConv(c.hidden_size, c.conv_L_cache, c.conv_bias)
            return Attention.of(c, qk_norm="head")

        return LfmDecoder(c, attention, c.rope(), moe=lambda: MoeBlock(c.hidden_size, c.n_experts, router, names=names))


FAMILY = Lfm2Moe()
