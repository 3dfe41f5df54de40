"""LFM2-MoE (LFM2-8B-A1B): a hybrid of short gated convolutions and GQA attention layers (`layer_types`: "conv" or
"full_attention"), dense feed-forward layers below `num_dense_layers`, then MoE layers with a sigmoid router whose
choice adds a per-expert bias (`expert_bias`, when `use_expert_bias`), weights renormalised (`norm_topk_prob`) and
scaled (`routed_scaling_factor`). Attention has per-head q/k RMSNorm and no biases.

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
from typing import Any, TypeVar

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention, Batch, row_slots
from moelane.model.checkpoint import renamed
from moelane.model.decoder import Decoder, DenseMlp, Routing, attention_heads, config_get
from moelane.model.layers import Rope, linear, pointwise, rope_parameters
from moelane.model.moe import biased_group_topk, run_experts
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
KEEP_FP32 = ("mlp.expert_bias",)  # (as transformers keeps it: it decides near-ties between experts)

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


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.feed_forward.experts"


def sanitize(weights: dict[str, T]) -> dict[str, T]:
    """Checkpoint names -> ours (values untouched)."""
    return renamed(weights, RENAMES)


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
    at = batch.positions[:, None] - torch.arange(kernel - 1, -1, -1)[None, :]  # [N, L]: p - (L-1) .. p
    if batch.pool is not None and batch.slots is not None:  # the compiled decode step: one pool
        return recall(batch.pool.k[layer], batch.slots, batch.positions, at, bx)
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
    return torch.where((at >= 0)[..., None], got, torch.zeros((), dtype=got.dtype)).to(bx.dtype)


class LfmMoe(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, n_experts = config["hidden_size"], int(config_get(config, "num_experts", "num_local_experts"))
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.expert_bias = nn.Buffer(torch.zeros(n_experts)) if config.get("use_expert_bias", True) else None
        self.top_k = config["num_experts_per_tok"]
        self.norm = bool(config.get("norm_topk_prob", True))
        self.scaling = float(config.get("routed_scaling_factor") or 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x, self.gate.weight)
        scores = pointwise(torch.sigmoid, logits)
        if self.expert_bias is None:
            weights, ids = torch.topk(scores, self.top_k, dim=-1)
        else:  # chosen by the biased scores, weighted by the scores themselves
            weights, ids = biased_group_topk(scores, self.expert_bias, self.top_k, 1, 1)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return weights * self.scaling, ids

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        return run_experts(x, layer, ids, weights, provider)


class LfmDecoder(Decoder):
    """The shared decoder with a cache shape per layer: conv layers keep one hidden vector per position."""

    def __init__(self, *args: Any, conv_layers: list[int], hidden: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conv_layers, self._hidden = conv_layers, hidden

    def cache_shapes(self) -> dict[int, tuple[int, int, int]]:
        shapes = super().cache_shapes()
        return {i: (1, self._hidden, 1) if i in self._conv_layers else shape for i, shape in shapes.items()}


def layer_types(config: dict[str, Any]) -> list[str]:
    n_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None and config.get("full_attn_idxs") is not None:  # (LFM2's older spelling)
        types = ["full_attention" if i in config["full_attn_idxs"] else "conv" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise ModelLoadError(f"lfm2_moe needs layer_types, one per layer ({n_layers}), got {types!r}")
    unknown = sorted(set(types) - {"conv", "full_attention"})
    if unknown:
        raise ModelLoadError(f"unknown layer_types {unknown} (lfm2_moe has conv and full_attention layers)")
    return types


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config.get("norm_eps", 1e-5)
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers = config["num_hidden_layers"]
    types = layer_types(config)
    kernel = int(config.get("conv_L_cache", 3))
    if kernel < 1:
        raise ModelLoadError(f"conv_L_cache must be >= 1, got {kernel}")
    n_dense = int(config.get("num_dense_layers", 2))
    moe_layers = [i for i in range(n_layers) if i >= n_dense]

    def make_attention(i: int) -> nn.Module:
        if types[i] == "conv":
            return ShortConv(hidden, kernel, bool(config.get("conv_bias")))
        return Attention(hidden, n_heads, n_kv, head_dim, qk_norm="head", eps=eps)

    def make_mlp(i: int) -> nn.Module:
        return LfmMoe(config) if i in moe_layers else DenseMlp(hidden, config["intermediate_size"])

    rope = Rope.build(
        rope_parameters(config, default_theta=1e6), head_dim, config.get("max_position_embeddings", 128000)
    )
    tied = config.get("tie_word_embeddings", config.get("tie_embedding", True))
    return LfmDecoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope, bool(tied), moe_layers,
        (n_kv, head_dim, head_dim), conv_layers=[i for i, t in enumerate(types) if t == "conv"], hidden=hidden,
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_experts", "num_local_experts"))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
