"""K-EXAONE (`exaone_moe`: K-EXAONE-236B-A23B): EXAONE 4's attention, GQA with per-head q/k RMSNorm and no biases,
in sliding-window layers that rotate and global layers that do not (no positional embedding at all: `layer_types`,
else every `sliding_window_pattern`-th layer global; transformers' config always has a window), with DeepSeek-V3's MoE
(`moe.SigmoidMoe`): sigmoid scores plus a learnt per-expert bias choose the experts within the `topk_group` best of
`n_group` groups, the unbiased scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`, weigh them;
shared experts of `num_shared_experts * moe_intermediate_size`; dense layers where `mlp_layer_types` says (else below
`first_k_dense_replace`). Pre-norm layers, as OLMoE's.

`settle` fills in transformers' defaults (a 4,096-position window on three layers of four, a scale of 2.5, ...),
writes out the per-layer lists as transformers derives them, and gives `num_experts` / `num_shared_experts` the
spellings `SigmoidMoe` reads. The router's weight and bias stay in fp32 (`KEEP_FP32`), as the reference keeps them;
the checkpoints' bias sits beside the router (`mlp.e_score_correction_bias`, renamed into it by `sanitize`), and their
multi-token-prediction tensors (`mtp.*`) are skipped, as transformers skips them."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, DenseMlp, attention_heads
from moelane.model.layers import Rope, rope_parameters
from moelane.model.moe import ROUTER_FP32, SigmoidMoe, check_groups

EXPERT_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
KEEP_FP32 = ROUTER_FP32
DEFAULTS = dict(sliding_window=4096, sliding_window_pattern=4, first_k_dense_replace=1, moe_intermediate_size=1024,
                num_experts=64, num_experts_per_tok=8, num_shared_experts=1, norm_topk_prob=True,
                routed_scaling_factor=2.5, n_group=1, topk_group=1, rms_norm_eps=1e-5, tie_word_embeddings=False,
                max_position_embeddings=2048)  # transformers' defaults, for keys a config leaves out  # fmt: skip
LAYER_KINDS, MLP_KINDS = ("sliding_attention", "full_attention"), ("dense", "sparse")  # (False, True) of each rule
T = TypeVar("T")


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts"


def sanitize(weights: dict[str, T]) -> dict[str, T]:
    """Checkpoint names -> ours (values untouched): the router's score bias into the router."""
    return {name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"): w
            for name, w in weights.items()}  # fmt: skip


def ignored(config: dict[str, Any], name: str) -> bool:
    return "mtp" in name  # the multi-token-prediction tensors, as transformers' `mtp.*`


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for the keys it leaves out, `layer_types` and `mlp_layer_types` written
    out, and `n_routed_experts` / `n_shared_experts` (the spellings `SigmoidMoe` reads); a ModelLoadError for what
    transformers does not compute."""
    out = {**DEFAULTS, **config}
    n_layers, window, pattern = int(out["num_hidden_layers"]), out["sliding_window"], out["sliding_window_pattern"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:  # (transformers' config: an int)
        raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
    if out.get("layer_types") is None:  # (as transformers derives them; a pattern string such as "LLLG" it cannot)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ModelLoadError(f"exaone_moe without layer_types needs a whole-number sliding_window_pattern, "
                                 f"got {pattern!r}")  # fmt: skip
        out["layer_types"] = [LAYER_KINDS[(i + 1) % pattern == 0] for i in range(n_layers)]
    if out.get("mlp_layer_types") is None:
        out["mlp_layer_types"] = [MLP_KINDS[i >= out["first_k_dense_replace"]] for i in range(n_layers)]
    for key, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
        if len(out[key]) != n_layers or not set(out[key]) <= set(kinds):
            raise ModelLoadError(f"exaone_moe needs {key}, one of {kinds} per layer ({n_layers}), got {out[key]!r}")
    out["n_routed_experts"], out["n_shared_experts"] = out["num_experts"], out["num_shared_experts"]
    return out


class NoPositionAttention(Attention):
    """EXAONE's global layers: queries and keys are not rotated."""

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers, window = config["num_hidden_layers"], config["sliding_window"]
    check_groups(n_experts(config), config["num_experts_per_tok"], config["n_group"] or 1, config["topk_group"] or 1)
    moe_layers = [i for i, kind in enumerate(config["mlp_layer_types"]) if kind == "sparse"]
    sliding = [kind == "sliding_attention" for kind in config["layer_types"]]

    def make_attention(i: int) -> nn.Module:
        if sliding[i]:
            return Attention(hidden, n_heads, n_kv, head_dim, qk_norm="head", eps=eps, window=window)
        return NoPositionAttention(hidden, n_heads, n_kv, head_dim, qk_norm="head", eps=eps)

    def make_mlp(i: int) -> nn.Module:
        return SigmoidMoe(config) if i in moe_layers else DenseMlp(hidden, config["intermediate_size"])

    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp,
        Rope.build(rope_parameters(config), head_dim, config["max_position_embeddings"]),
        bool(config["tie_word_embeddings"]), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config["num_experts"])


def expert_width(config: dict[str, Any]) -> int:
    return int(config["moe_intermediate_size"])
