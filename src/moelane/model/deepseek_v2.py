"""DeepSeek-V2 (V2, V2-Lite, V2.5): multi-head latent attention (MLA), shared experts, group-limited routing.

MLA: q comes straight from `q_proj` or through a low-rank bottleneck (`q_a_proj`, RMSNorm, `q_b_proj`) when
`q_lora_rank` is set; keys and values are decompressed from one `kv_lora_rank` latent (`kv_a_proj_with_mqa`,
RMSNorm, `kv_b_proj`) plus a single rotary key part shared by all heads. Each head's query/key is `qk_nope_head_dim`
plain dims followed by `qk_rope_head_dim` rotary dims; values are `v_head_dim` wide. Rotary pairs are interleaved
(adjacent dims), unlike Llama's halves, and rotated in fp32. The cache holds the decompressed per-head keys and
values (simple, not memory-lean: MLA could cache the latent instead). Yarn scaling with `mscale_all_dim` also scales
the softmax by mscale^2.

Routing: softmax over experts (the router's weight kept in fp32, as the reference keeps it), top-k `greedy` or
`group_limited_greedy` (keep the `topk_group` groups of `n_group` with the best single expert, then top-k among
them). As in DeepSeek's own code, weights are renormalised when `norm_topk_prob` (and k > 1), otherwise multiplied by
`routed_scaling_factor` (transformers 5.24 always scales and ignores `norm_topk_prob`; the released checkpoints have
it false, where both agree). `n_shared_experts` always-on experts (one MLP of `n_shared_experts *
moe_intermediate_size`) are added. Layers below `first_k_dense_replace` are dense, and above it every
`moe_layer_freq`-th.

A config without `q_lora_rank` or `n_shared_experts` gets transformers' defaults (1536, 2), so a checkpoint that does
not match them is refused (missing tensors, other shapes) instead of loading with its shared experts or low-rank q
ignored; an explicit null means none, as in DeepSeek's code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Batch, attend_streams
from moelane.model.decoder import Decoder, DenseMlp, Routing, config_get
from moelane.model.layers import MLP, RMSNorm, Rope, apply_rope, linear, rope_parameters
from moelane.model.moe import ROUTER_FP32, run_experts
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
TOPK_METHODS = ("greedy", "group_limited_greedy")

KEEP_FP32 = ROUTER_FP32  # (as transformers keeps the router's weight)


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over interleaved pairs (x0, x1), (x2, x3), ... of x [N, heads, R], in the dtype of cos.

    The pairs are regrouped as halves first (evens, then odds) and rotated Llama-style; queries and keys both come out
    in that order, which leaves their dot products unchanged."""
    halves = x.to(cos.dtype).view(*x.shape[:-1], -1, 2).transpose(-1, -2).flatten(-2)
    return apply_rope(halves, cos, sin).to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama-style rotary embedding of x [N, heads, R] (DeepSeek-V3 with `rope_interleave` false)."""
    return apply_rope(x.to(cos.dtype), cos, sin).to(x.dtype)


class LatentAttention(nn.Module):
    """MLA. `rope_dtype`: the dtype rotary embeddings are computed in (V2's reference: fp32; None: the model's, as
    V3's); `interleave`: rotary dims in interleaved pairs (V2, V3's `rope_interleave`) or in halves."""

    def __init__(
        self,
        config: dict[str, Any],
        rope: Rope,
        rope_dtype: torch.dtype | None = torch.float32,
        interleave: bool = True,
    ) -> None:
        super().__init__()
        self.rope_dtype, self.rotate = rope_dtype, rotate_pairs if interleave else rotate_halves
        hidden, n_heads = config["hidden_size"], config["num_attention_heads"]
        self.n_heads = n_heads
        self.nope, self.rope_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.v_dim = config["v_head_dim"]
        self.kv_rank, self.q_rank = config["kv_lora_rank"], config.get("q_lora_rank", 1536)
        qk_dim, bias = self.nope + self.rope_dim, bool(config.get("attention_bias"))
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
        self.scale = qk_dim**-0.5 * softmax_mscale(rope_parameters(config)) ** 2

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


def grouped_topk(
    logits: torch.Tensor, k: int, method: str, n_group: int, topk_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores [T, E]; top-k over all experts (greedy) or over the `topk_group` best groups. -> (scores, ids)."""
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        n_tokens, n_experts = scores.shape
        best = scores.view(n_tokens, n_group, n_experts // n_group).amax(dim=-1)  # [T, G]
        keep = torch.zeros_like(best).scatter_(1, torch.topk(best, topk_group, dim=-1).indices, 1.0)
        scores = scores.masked_fill(keep.repeat_interleave(n_experts // n_group, dim=1) == 0, 0.0)
    weights, ids = torch.topk(scores, k, dim=-1)
    return weights, ids


class DeepseekMoe(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.gate = nn.Linear(hidden, n_experts(config), bias=False)
        n_shared = config.get("n_shared_experts", 2) or 0
        width = n_shared * config["moe_intermediate_size"]
        self.shared_experts = MLP(hidden, width, bool(config.get("mlp_bias"))) if n_shared else None
        self.top_k, self.method = config["num_experts_per_tok"], config.get("topk_method") or "greedy"
        self.n_group, self.topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
        self.norm = bool(config.get("norm_topk_prob")) and self.top_k > 1
        self.scaling = float(config.get("routed_scaling_factor") or 1.0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x.float(), self.gate.weight.float())  # [T, E], router in fp32 like the reference
        weights, ids = grouped_topk(logits, self.top_k, self.method, self.n_group, self.topk_group)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) if self.norm else weights * self.scaling, ids

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        out = run_experts(x, layer, ids, weights, provider)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def check(config: dict[str, Any]) -> None:
    method = config.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ModelLoadError(f"unsupported topk_method {method!r} (supported: {', '.join(TOPK_METHODS)})")
    if method == "group_limited_greedy":
        n_group, topk_group = config.get("n_group") or 0, config.get("topk_group") or 0
        if n_group < 1 or n_experts(config) % n_group or not 1 <= topk_group <= n_group:
            raise ModelLoadError(
                f"group_limited_greedy needs n_group dividing {n_experts(config)} experts and "
                f"1 <= topk_group <= n_group, got n_group={n_group}, topk_group={topk_group}"
            )
    check_latent(config)


def check_latent(config: dict[str, Any]) -> None:
    """What the latent attention (V2's and V3's) needs of a config."""
    n_kv = config.get("num_key_value_heads") or config["num_attention_heads"]
    if n_kv != config["num_attention_heads"]:
        raise ModelLoadError(f"MLA needs num_key_value_heads == num_attention_heads, got {n_kv}")


def is_moe_layer(config: dict[str, Any], i: int) -> bool:
    first_dense = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return n_experts(config) > 0 and i >= first_dense and i % freq == 0


def build(config: dict[str, Any]) -> Decoder:
    check(config)
    return build_latent(config, lambda: DeepseekMoe(config), torch.float32, interleave=True)


def build_latent(
    config: dict[str, Any],
    make_moe: Callable[[], nn.Module],
    rope_dtype: torch.dtype | None,
    interleave: bool,
    moe_layers: list[int] | None = None,
) -> Decoder:
    """A DeepSeek decoder: MLA in every layer, `make_moe()` in the MoE layers (`moe_layers`, by default DeepSeek's
    `is_moe_layer`), dense MLPs elsewhere."""
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    if moe_layers is None:
        moe_layers = [i for i in range(n_layers) if is_moe_layer(config, i)]
    rope = Rope.build(rope_parameters(config), config["qk_rope_head_dim"], config.get("max_position_embeddings", 4096))

    def make_mlp(i: int) -> nn.Module:
        if i in moe_layers:
            return make_moe()
        return DenseMlp(hidden, config["intermediate_size"], bool(config.get("mlp_bias")))

    qk_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, lambda i: LatentAttention(config, rope, rope_dtype, interleave),
        make_mlp, rope, bool(config.get("tie_word_embeddings")), moe_layers, (n_heads, qk_dim, config["v_head_dim"]),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "n_routed_experts", "num_experts", default=0))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
