"""ERNIE 4.5 MoE (`ernie4_5_moe`: ERNIE-4.5-21B-A3B-PT, ERNIE-4.5-300B-A47B-PT): GQA rotating interleaved pairs in
fp32 (`deepseek_v2.rotate_pairs`); a softmax router whose top-k choice adds a learnt per-expert bias
(`mlp.moe_statics.e_score_correction_bias`) to the probabilities, weighing by the unbiased ones renormalised over a
sum clamped to `moe_norm_min`; a shared expert MLP of `moe_num_shared_experts * moe_intermediate_size`; MoE layers
every `moe_layer_interval`-th from `moe_layer_start_index` to `moe_layer_end_index`. `use_bias` gives every
projection a bias, the LM head's too (not the experts' or the router's); embeddings tied unless the config says not.

`settle` (which `load` calls first) fills in transformers' defaults, and gives `moe_num_experts` / `moe_k` the
spellings `load` and the LM read (`num_experts`, `num_experts_per_tok`). The router stays in fp32 (`KEEP_FP32`), as the
reference keeps it; the multi-token-prediction tensors (`mtp`) are skipped, as transformers skips them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, Routing, attention_heads, config_get
from moelane.model.deepseek_v2 import rotate_pairs
from moelane.model.layers import MLP, Rope, linear, rope_parameters
from moelane.model.moe import run_experts
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
KEEP_FP32 = ("mlp.gate.weight", "mlp.moe_statics.e_score_correction_bias")
DEFAULTS = dict(moe_num_experts=64, moe_k=6, moe_num_shared_experts=2, moe_intermediate_size=1536, moe_norm_min=1e-12,
                moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1, use_bias=False,
                tie_word_embeddings=True, rms_norm_eps=1e-5)  # transformers' defaults  # fmt: skip


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def ignored(config: dict[str, Any], name: str) -> bool:
    return "mtp" in name  # the multi-token-prediction block (`model.mtp_*`)


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for keys it leaves out, and `num_experts` / `num_experts_per_tok` (the
    spellings `load` and the LM's args read) from `moe_num_experts` / `moe_k`."""
    out = dict(config)
    out["moe_num_experts"] = config_get(config, "moe_num_experts", "num_experts", default=None)
    out["moe_k"] = config_get(config, "moe_k", "num_experts_per_tok", default=None)
    out.update({key: value for key, value in DEFAULTS.items() if out.get(key) is None})
    out["num_experts"], out["num_experts_per_tok"] = out["moe_num_experts"], out["moe_k"]
    return out


class Fp32Rope(Rope):
    """Rotary cos/sin in fp32 whatever the model's dtype: the reference rotates in fp32 and rounds once."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return super().cos_sin(positions, torch.float32)


class PairRopeAttention(Attention):
    """GQA without q/k norms or windows, rotating interleaved pairs (queries and keys come out in halves order)."""

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)


class ErnieMoe(nn.Module):
    """Routed experts (softmax router, choice biased by `moe_statics`) plus the shared experts' MLP, if any."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden, n_shared, bias = config["hidden_size"], int(config["moe_num_shared_experts"]), config["use_bias"]
        self.gate = nn.Linear(hidden, n_experts(config), bias=False)
        self.moe_statics = nn.Module()  # (the checkpoint's place for the bias: `mlp.moe_statics.*`)
        self.moe_statics.register_buffer("e_score_correction_bias", torch.zeros(1, n_experts(config)))
        self.shared_experts = MLP(hidden, n_shared * expert_width(config), bool(bias)) if n_shared else None
        self.top_k, self.norm_min = int(config["moe_k"]), float(config["moe_norm_min"])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(linear(x.float(), self.gate.weight.float()), dim=-1)
        bias = self.moe_statics.get_buffer("e_score_correction_bias").float()[0]
        ids = torch.topk(probs + bias, self.top_k, dim=-1).indices
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(x.dtype), ids  # (rounded to the model's dtype, as transformers' router gives them)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        out = run_experts(x, layer, ids, weights, provider)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps, bias = config["hidden_size"], config["rms_norm_eps"], bool(config["use_bias"])
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers, interval = config["num_hidden_layers"], int(config["moe_layer_interval"])
    if interval < 1:
        raise ModelLoadError(f"moe_layer_interval must be a whole number >= 1, got {interval}")
    start, end = int(config["moe_layer_start_index"]), int(config["moe_layer_end_index"])
    end = n_layers - 1 if end == -1 else end  # (as transformers: -1 is the last layer, no other count from the end)
    moe_layers = [i for i in range(n_layers) if n_experts(config) > 0 and (i + 1) % interval == 0 and start <= i <= end]

    def make_attention(i: int) -> nn.Module:
        return PairRopeAttention(hidden, n_heads, n_kv, head_dim, bias, None, eps, o_bias=bias)

    def make_mlp(i: int) -> nn.Module:
        return ErnieMoe(config) if i in moe_layers else DenseMlp(hidden, config["intermediate_size"], bias)

    rope = Fp32Rope.build(rope_parameters(config, 500000.0), head_dim, config.get("max_position_embeddings", 131072))
    model = Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config["tie_word_embeddings"]), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip
    if bias:  # (the LM head's too: `Decoder.logits` adds it)
        model.lm_head.bias = nn.Parameter(torch.zeros(config["vocab_size"]))
    return model


def n_experts(config: dict[str, Any]) -> int:
    return int(config["moe_num_experts"])


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
