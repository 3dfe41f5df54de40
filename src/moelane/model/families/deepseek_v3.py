"""DeepSeek-V3 and R1 (`deepseek_v3`; their FP8 originals too): multi-head latent attention (`latent.LatentAttention`)
with rotary embeddings in the model's dtype, in interleaved pairs or, with `rope_interleave: false`, in halves; routing
"noaux_tc" (`routers.SigmoidTopK`): sigmoid scores plus a learnt per-expert bias choose the experts within the
`topk_group` best of `n_group` groups, the unbiased scores, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`, weigh them; shared experts; dense layers below `first_k_dense_replace`.

Keys a config leaves out take transformers' defaults (8 groups keeping 4, a scale of 2.5, ...). The router stays in
fp32 whatever the model's dtype, as the reference keeps it, and the checkpoints' multi-token-prediction layer is
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelane.errors import ModelLoadError
from moelane.model.config import key
from moelane.model.decoder import Decoder
from moelane.model.family import ROUTER_FP32, Family, past_last_layer
from moelane.model.latent import LatentConfig, check_latent, deepseek_moe_layers, latent_decoder
from moelane.model.moe import SCORED, MoeBlock, shared_experts
from moelane.model.routers import SigmoidTopK, check_groups


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepseekV3Config(LatentConfig):
    n_experts: int = key("n_routed_experts", "num_experts", default=0, low=0)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    n_shared_experts: int | None = key(default=1, keep_null=True, low=0)  # null: none
    n_group: int = key(default=8, low=1)
    topk_group: int = key(default=4, low=1)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = key(default=3, low=0)
    moe_layer_freq: int = key(default=1, low=1)
    rope_interleave: bool = True
    topk_method: str = "noaux_tc"

    def check(self) -> None:
        if self.topk_method != "noaux_tc":
            raise ModelLoadError(f"deepseek_v3 routes with topk_method 'noaux_tc', got {self.topk_method!r}")
        check_latent(self)
        check_groups(self.n_experts, self.top_k or 0, self.n_group, self.topk_group)

    def moe_layers(self) -> list[int]:
        return deepseek_moe_layers(self.num_hidden_layers, self.n_experts, self.first_k_dense_replace,
                                   self.moe_layer_freq)  # fmt: skip


class DeepseekV3(Family[DeepseekV3Config]):
    config_class = DeepseekV3Config
    keep_fp32 = ROUTER_FP32

    def ignored(self, config: DeepseekV3Config, name: str) -> bool:
        return past_last_layer(config.num_hidden_layers, name)  # the multi-token-prediction layer

    def build(self, config: DeepseekV3Config) -> Decoder:
        c = config

        def moe() -> MoeBlock:
            router = SigmoidTopK(c.k, c.norm_topk_prob, c.routed_scaling_factor, c.n_group, c.topk_group)
            shared = shared_experts(c.hidden_size, c.n_shared_experts, c.moe_width)
            return MoeBlock(c.hidden_size, c.n_experts, router, names=SCORED, shared=shared)

        return latent_decoder(c, moe, None, c.rope_interleave)


FAMILY = DeepseekV3()
