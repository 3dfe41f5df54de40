"""Hunyuan MoE (`hunyuan_v1_moe`: Hunyuan-A13B-Instruct): GQA with per-head q/k RMSNorm applied after the rotary
embedding (`query_layernorm` / `key_layernorm`), `attention_bias` on all four projections; every layer MoE, a softmax
router (`mlp.gate.wg`, kept in fp32 as the reference keeps it) whose top-k weights are always renormalised, plus one
always-on shared MLP (`mlp.shared_mlp`) as wide as the experts (`intermediate_size`). Rope "dynamic" with an `alpha`
(NTK-alpha) only raises the base, to `rope_theta * alpha ** (d / (d - 2))`, whatever the length.

`settle` (which `load` calls first) fills in transformers' defaults, turns the per-layer lists of Tencent's configs
(`moe_topk`, `num_experts`, ...) into their one value, and gives `moe_topk` the spelling `load` and the LM read
(`num_experts_per_tok`). Lists whose values differ are refused, and so are the keys of Tencent's own code that
transformers 5.24 ignores (cross-layer attention `use_cla`, a shared MLP off or of other widths, `mlp_bias`, no q/k
norm): a checkpoint that needs them would not compute what it was trained to."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, Routing, attention_heads
from moelane.model.layers import MLP, RMSNorm, Rope, apply_rope, linear, rope_parameters
from moelane.model.moe import run_experts, softmax_topk
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
KEEP_FP32 = ("mlp.gate.wg.weight",)
DEFAULTS = dict(num_experts=1, moe_topk=1, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                max_position_embeddings=2048)  # transformers' defaults  # fmt: skip
PER_LAYER = ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert")


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults, per-layer lists made one value, `num_experts_per_tok` from `moe_topk`;
    a ModelLoadError for what transformers does not compute."""
    out = {**config, **{key: value for key, value in DEFAULTS.items() if config.get(key) is None}}
    for key in PER_LAYER:
        if isinstance(out.get(key), list):
            if len(set(out[key])) != 1:
                raise ModelLoadError(f"hunyuan_v1_moe with per-layer {key} that differ is not supported: {out[key]}")
            out[key] = out[key][0]
    width = out.get("moe_intermediate_size")
    if out.get("use_cla") or out.get("mlp_bias") or out.get("use_qk_norm") is False:
        raise ModelLoadError("hunyuan_v1_moe with use_cla, mlp_bias or no use_qk_norm is not supported")
    if out.get("use_mixed_mlp_moe") is False or out.get("num_shared_expert", 1) != 1:
        raise ModelLoadError("hunyuan_v1_moe needs one shared MLP (use_mixed_mlp_moe, num_shared_expert 1)")
    if width is not None and width != out.get("intermediate_size"):
        raise ModelLoadError(f"hunyuan_v1_moe needs moe_intermediate_size == intermediate_size, got {width}")
    out["num_experts_per_tok"] = out["moe_topk"]
    return out


class NormAfterRopeAttention(Attention):
    """GQA whose per-head q/k RMSNorms come after the rotary embedding."""

    def __init__(self, hidden: int, n_heads: int, n_kv: int, head_dim: int, bias: bool, eps: float) -> None:
        super().__init__(hidden, n_heads, n_kv, head_dim, bias, None, eps, o_bias=bias)
        self.query_layernorm, self.key_layernorm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_layernorm(apply_rope(q, cos, sin)), self.key_layernorm(apply_rope(k, cos, sin))


class Gate(nn.Module):
    def __init__(self, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, n_experts, bias=False)  # (the checkpoint's name: `mlp.gate.wg.weight`)


class HunyuanMoe(nn.Module):
    """Routed experts (fp32 softmax router, top-k renormalised) plus the shared MLP."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.gate = Gate(hidden, n_experts(config))
        self.shared_mlp = MLP(hidden, expert_width(config))
        self.top_k = int(config["moe_topk"])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(linear(x.float(), self.gate.wg.weight.float()), self.top_k, True)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        shared: torch.Tensor = self.shared_mlp(x)
        return run_experts(x, layer, ids, weights, provider) + shared


def rope(config: dict[str, Any], head_dim: int) -> Rope:
    params = rope_parameters(config)
    if params["rope_type"] == "dynamic" and params.get("alpha"):  # NTK-alpha: a fixed larger base
        base = float(params["rope_theta"]) * float(params["alpha"]) ** (head_dim / (head_dim - 2))
        params = {"rope_theta": base, "rope_type": "default"}
    return Rope.build(params, head_dim, config["max_position_embeddings"])


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps, bias = config["hidden_size"], config["rms_norm_eps"], bool(config["attention_bias"])
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers = config["num_hidden_layers"]
    if n_experts(config) < 1:
        raise ModelLoadError("hunyuan_v1_moe needs num_experts >= 1")

    def make_attention(i: int) -> nn.Module:
        return NormAfterRopeAttention(hidden, n_heads, n_kv, head_dim, bias, eps)

    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, lambda i: HunyuanMoe(config),
        rope(config, head_dim), bool(config["tie_word_embeddings"]), list(range(n_layers)), (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config["num_experts"])


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
