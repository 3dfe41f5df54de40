"""dots.llm1 (`dots1`: dots.llm1.base, dots.llm1.inst): Qwen3's attention (GQA, per-head q/k RMSNorm before the rotary
embedding, `attention_bias` on q/k/v/o) with DeepSeek-V3's MoE (`moe.SigmoidMoe`: sigmoid router with a score bias on
the choice and group limits, weights renormalised when `norm_topk_prob` and scaled by `routed_scaling_factor`, shared
experts of `n_shared_experts * moe_intermediate_size`); dense layers below `first_k_dense_replace`, every later layer
MoE. Sliding-window layers as transformers reads them: `layer_types`, or else every layer from `max_window_layers` on
while `sliding_window` is set (their defaults, 4096 and 62, slide no layer of the released 62-layer models).

`settle` fills in transformers' defaults for keys a config leaves out (no groups, weights not renormalised, a scale of
1, ...). A null `n_group` / `topk_group` reads as no group limit (transformers 5.24 fails on it). Settings transformers
ignores are refused where they say otherwise (`moe_layer_freq` other than 1, a `scoring_func` other than sigmoid or a
`topk_method` other than "noaux_tc", sliding layers under `use_sliding_window: false`), and so is a config without
`n_shared_experts`, which transformers cannot build. The router stays in fp32 (`KEEP_FP32`), as the reference keeps
it."""

from __future__ import annotations

from typing import Any

from torch import nn

from moelane.errors import ModelLoadError
from moelane.model import glm4_moe
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, attention_heads, config_get
from moelane.model.layers import Rope, rope_parameters
from moelane.model.moe import ROUTER_FP32, SigmoidMoe, check_groups

EXPERT_NAMES = glm4_moe.EXPERT_NAMES
KEEP_FP32 = ROUTER_FP32
DEFAULTS = dict(n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.0,
                rms_norm_eps=1e-6, max_position_embeddings=2048, sliding_window=4096, max_window_layers=62,
                attention_bias=False, tie_word_embeddings=False)  # transformers' defaults  # fmt: skip
expert_prefix, expert_width = glm4_moe.expert_prefix, glm4_moe.expert_width


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for keys it leaves out; a ModelLoadError for what transformers ignores
    or cannot compute."""
    out = {**DEFAULTS, **config}
    if out.get("n_shared_experts") is None:
        raise ModelLoadError("dots1 needs n_shared_experts (transformers has no default for it)")
    if out.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(f"dots1 has MoE in every layer from first_k_dense_replace, got moe_layer_freq "
                             f"{out['moe_layer_freq']}")  # fmt: skip
    scoring, method = out.get("scoring_func") or "sigmoid", out.get("topk_method") or "noaux_tc"
    if (scoring, method) != ("sigmoid", "noaux_tc"):
        raise ModelLoadError(f"dots1 routes with sigmoid scores and topk_method 'noaux_tc', got scoring_func "
                             f"{scoring!r}, topk_method {method!r}")  # fmt: skip
    return out


def sliding_windows(config: dict[str, Any]) -> list[int | None]:
    """Per layer, its sliding window (None: full attention), as transformers reads the config."""
    n_layers, window = config["num_hidden_layers"], config["sliding_window"]
    kinds = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= config["max_window_layers"] else "full_attention"
        for i in range(n_layers)
    ]
    if len(kinds) != n_layers or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"dots1 needs layer_types 'full_attention' or 'sliding_attention', one per layer "
                             f"({n_layers}), got {kinds}")  # fmt: skip
    if "sliding_attention" in kinds:
        if type(window) is not int or window < 1:
            raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
        if config.get("use_sliding_window") is False:
            raise ModelLoadError("dots1 with sliding layers but use_sliding_window false is not supported "
                                 "(transformers slides them, Qwen-style code would not)")  # fmt: skip
    return [window if kind == "sliding_attention" else None for kind in kinds]


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps, bias = config["hidden_size"], config["rms_norm_eps"], bool(config["attention_bias"])
    n_heads, n_kv, head_dim = attention_heads(config)
    check_groups(n_experts(config), config["num_experts_per_tok"], config["n_group"] or 1, config["topk_group"] or 1)
    n_layers, windows = config["num_hidden_layers"], sliding_windows(config)
    first_dense = int(config["first_k_dense_replace"] or 0)
    moe_layers = list(range(first_dense, n_layers))

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, "head", eps, o_bias=bias, window=windows[i])

    def make_mlp(i: int) -> nn.Module:
        return SigmoidMoe(config) if i in moe_layers else DenseMlp(hidden, config["intermediate_size"])

    rope = Rope.build(rope_parameters(config), head_dim, config["max_position_embeddings"])
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config["tie_word_embeddings"]), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "n_routed_experts", "num_local_experts"))  # (no default: transformers has none)
