"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`): GQA with q/k/v bias and optional per-head q/k RMSNorm
(`use_qk_norm`), rotary embeddings on the first `partial_rotary_factor` of each head (default 0.5, Llama-style
halves); a sigmoid router whose choice adds a learnt per-expert bias (`e_score_correction_bias`) and is limited to
the `topk_group` best of `n_group` groups (a group's score: its two best experts), while the weights are the
unbiased sigmoid scores, renormalised when `norm_topk_prob` and scaled by `routed_scaling_factor`; one always-on
shared expert MLP of `n_shared_experts * moe_intermediate_size`; dense layers below `first_k_dense_replace`.

The router's weight and bias stay in fp32 whatever the model's dtype, as the reference keeps them (`KEEP_FP32`):
the bias shifts which experts are chosen, and bf16 would move near-ties. The checkpoints' multi-token-prediction
layer (`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers`) is not used for decoding and is skipped
(`ignored`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, attention_heads, config_get, past_last_layer
from moelane.model.layers import Rope, rope_parameters
from moelane.model.moe import ROUTER_FP32, SigmoidMoe, check_groups

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
KEEP_FP32 = ROUTER_FP32


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


ignored = past_last_layer  # the multi-token-prediction layer's tensors


def check(config: dict[str, Any], head_dim: int, rotary_dim: int) -> None:
    n_group, topk_group = config.get("n_group") or 1, config.get("topk_group") or 1
    check_groups(n_experts(config), config["num_experts_per_tok"], n_group, topk_group)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ModelLoadError(f"partial_rotary_factor gives {rotary_dim} rotary dims of a head's {head_dim}; "
                             "they must be an even number from 2 to the head's")  # fmt: skip


DEFAULTS = dict(n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                first_k_dense_replace=1)  # transformers' defaults where a config leaves a key out  # fmt: skip


def build(config: dict[str, Any]) -> Decoder:
    config = {**DEFAULTS, **config}
    hidden, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-5)
    n_heads, n_kv, head_dim = attention_heads(config)
    params = rope_parameters(config)
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    rotary_dim = int(head_dim * float(factor if factor is not None else 0.5))
    check(config, head_dim, rotary_dim)
    n_layers = config["num_hidden_layers"]
    first_dense = int(config["first_k_dense_replace"] or 0)
    moe_layers = [i for i in range(n_layers) if n_experts(config) > 0 and i >= first_dense]
    bias, qk_norm = bool(config.get("attention_bias")), "head" if config.get("use_qk_norm") else None

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, qk_norm, eps, rotary_dim=rotary_dim)

    def make_mlp(i: int) -> nn.Module:
        return SigmoidMoe(config) if i in moe_layers else DenseMlp(hidden, config["intermediate_size"])

    rope = Rope.build(params, rotary_dim, config.get("max_position_embeddings", 131072))
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config.get("tie_word_embeddings")), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "n_routed_experts", "num_local_experts", default=0))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
