"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's multi-head latent attention (`deepseek_v2.LatentAttention`, rotary
dims in interleaved pairs unless `rope_interleave` is false, in the model's dtype) with GLM-4.5's MoE (`moe.SigmoidMoe`:
sigmoid router with a score bias on the choice and group limits, weights renormalised when `norm_topk_prob` and scaled
by `routed_scaling_factor`, one shared expert MLP). What it has of its own: which layers are MoE is `mlp_layer_types`
("dense" / "sparse", one per layer; by default the first dense, the rest sparse), and its defaults (`DEFAULTS`: a
768-rank low-rank query, a scale of 1.8, ...).

transformers 5.24 reads only `mlp_layer_types`: the hub configs' `first_k_dense_replace` (1) is refused where it says
otherwise, and so are settings transformers ignores or cannot compute (`mlp_bias`, a `topk_method` other than
"noaux_tc", a `partial_rotary_factor` other than 1: the rotary dims are all `qk_rope_head_dim`). The router stays in
fp32 (`KEEP_FP32`), as the reference keeps it; the multi-token-prediction layer (`model.layers.{num_hidden_layers}`)
is skipped."""

from __future__ import annotations

from typing import Any

from moelane.errors import ModelLoadError
from moelane.model import deepseek_v2, glm4_moe
from moelane.model.decoder import Decoder, past_last_layer
from moelane.model.layers import rope_parameters
from moelane.model.moe import ROUTER_FP32, SigmoidMoe, check_groups

EXPERT_NAMES = glm4_moe.EXPERT_NAMES
KEEP_FP32 = ROUTER_FP32
DEFAULTS = dict(n_routed_experts=64, num_experts_per_tok=4, n_shared_experts=1, q_lora_rank=768, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8, rope_interleave=True, rms_norm_eps=1e-5,
                max_position_embeddings=202752)  # transformers' defaults where a config leaves a key out  # fmt: skip
expert_prefix, n_experts, expert_width = glm4_moe.expert_prefix, glm4_moe.n_experts, glm4_moe.expert_width
ignored = past_last_layer  # the multi-token-prediction layer's tensors


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for keys it leaves out; a ModelLoadError for what transformers ignores
    or cannot compute."""
    out = {**DEFAULTS, **config}
    partial = rope_parameters(out).get("partial_rotary_factor", out.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"glm4_moe_lite turns all qk_rope_head_dim dims, got partial_rotary_factor {partial}")
    if out.get("mlp_bias"):
        raise ModelLoadError("glm4_moe_lite with mlp_bias is not supported (transformers ignores it)")
    method = out.get("topk_method") or "noaux_tc"
    if method != "noaux_tc":
        raise ModelLoadError(f"glm4_moe_lite routes with topk_method 'noaux_tc', got {method!r}")
    return out


def moe_layers(config: dict[str, Any]) -> list[int]:
    """The layers `mlp_layer_types` marks "sparse" (by default all but the first), checked against a
    `first_k_dense_replace` the config also gives."""
    n_layers = config["num_hidden_layers"]
    kinds = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1)
    if len(kinds) != n_layers or not set(kinds) <= {"dense", "sparse"}:
        raise ModelLoadError(f"glm4_moe_lite needs mlp_layer_types 'dense' or 'sparse', one per layer ({n_layers}), "
                             f"got {kinds}")  # fmt: skip
    first_dense = config.get("first_k_dense_replace")
    if first_dense is not None and kinds != ["dense"] * first_dense + ["sparse"] * (n_layers - first_dense):
        raise ModelLoadError(f"glm4_moe_lite's first_k_dense_replace {first_dense} contradicts mlp_layer_types {kinds} "
                             "(transformers reads only mlp_layer_types)")  # fmt: skip
    return [i for i, kind in enumerate(kinds) if kind == "sparse"]


def build(config: dict[str, Any]) -> Decoder:
    deepseek_v2.check_latent(config)
    check_groups(n_experts(config), config["num_experts_per_tok"], config["n_group"] or 1, config["topk_group"] or 1)
    interleave = config["rope_interleave"] is not False
    return deepseek_v2.build_latent(config, lambda: SigmoidMoe(config), None, interleave, moe_layers(config))
