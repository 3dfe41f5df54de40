"""DeepSeek-V3 and R1 (`deepseek_v3`; bf16 or fp32 checkpoints: the FP8 originals are refused at load, as every
quantized one is): DeepSeek-V2's multi-head latent attention (`deepseek_v2.LatentAttention`) with rotary embeddings
in the model's dtype, in interleaved pairs or, with `rope_interleave: false`, in halves; routing "noaux_tc" as
GLM-4.5 routes (`moe.SigmoidMoe`): sigmoid scores plus a learnt per-expert bias choose the experts within the
`topk_group` best of `n_group` groups, the unbiased scores, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`, weigh them; shared experts; dense layers below `first_k_dense_replace`.

Keys a config leaves out take transformers' defaults (`DEFAULTS`: 8 groups keeping 4, a scale of 2.5, ...). The
router stays in fp32 whatever the model's dtype, as the reference keeps it, and the checkpoints' multi-token-prediction
layer is skipped, as in `glm4_moe`.
"""

from __future__ import annotations

from typing import Any

from moelane.errors import ModelLoadError
from moelane.model import deepseek_v2
from moelane.model.decoder import Decoder, past_last_layer
from moelane.model.moe import ROUTER_FP32, SigmoidMoe, check_groups

EXPERT_NAMES = deepseek_v2.EXPERT_NAMES
KEEP_FP32 = ROUTER_FP32
DEFAULTS = dict(n_shared_experts=1, q_lora_rank=1536, n_group=8, topk_group=4, first_k_dense_replace=3,
                norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True)  # fmt: skip
expert_prefix, n_experts, expert_width = deepseek_v2.expert_prefix, deepseek_v2.n_experts, deepseek_v2.expert_width
ignored = past_last_layer  # the multi-token-prediction layer's tensors


def build(config: dict[str, Any]) -> Decoder:
    config = {**DEFAULTS, **config}
    method = config.get("topk_method") or "noaux_tc"
    if method != "noaux_tc":
        raise ModelLoadError(f"deepseek_v3 routes with topk_method 'noaux_tc', got {method!r}")
    deepseek_v2.check_latent(config)
    check_groups(n_experts(config), config["num_experts_per_tok"], config["n_group"] or 1, config["topk_group"] or 1)
    interleave = config["rope_interleave"] is not False
    return deepseek_v2.build_latent(config, lambda: SigmoidMoe(config), None, interleave)
