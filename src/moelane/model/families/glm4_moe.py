"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`): GQA with q/k/v bias and optional per-head q/k RMSNorm
(`use_qk_norm`), rotary embeddings on the first `partial_rotary_factor` of each head (default 0.5, Llama-style
halves); DeepSeek-V3's routing (`routers.SigmoidTopK`: a sigmoid router whose choice adds a learnt per-expert bias
and is limited to the `topk_group` best of `n_group` groups, weighed by the unbiased scores, renormalised when
`norm_topk_prob` and scaled by `routed_scaling_factor`); one always-on shared expert MLP of `n_shared_experts *
moe_intermediate_size`; dense layers below `first_k_dense_replace`.

The router's weight and bias stay in fp32 whatever the model's dtype, as the reference keeps them (`keep_fp32`): the
bias shifts which experts are chosen, and bf16 would move near-ties. The checkpoints' multi-token-prediction layer
(`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers`) is not used for decoding and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import ROUTER_FP32, Family, past_last_layer
from moelane.model.moe import SCORED, MoeBlock, shared_experts
from moelane.model.routers import SigmoidTopK, check_groups


@dataclass(frozen=True, slots=True, kw_only=True)
class Glm4MoeConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=131072, low=1)
    n_experts: int = key("n_routed_experts", "num_local_experts", default=0, low=0)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    n_shared_experts: int | None = key(default=1, keep_null=True, low=0)  # null: none
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = key(default=1, low=1)
    topk_group: int = key(default=1, low=1)
    first_k_dense_replace: int = key(default=1, low=0)
    attention_bias: bool = False
    use_qk_norm: bool = False
    partial_rotary_factor: float = 0.5  # (hub configs keep it at the top level, transformers 5 in rope_parameters)

    def check(self) -> None:
        check_groups(self.n_experts, self.top_k or 0, self.n_group, self.topk_group)
        rotary, head = self.rotary_dim(), self.head_size
        if not 0 < rotary <= head or rotary % 2:
            raise ModelLoadError(f"partial_rotary_factor gives {rotary} rotary dims of a head's {head}; "
                                 "they must be an even number from 2 to the head's")  # fmt: skip

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.n_experts > 0 and i >= self.first_k_dense_replace]

    def rotary_dim(self) -> int:
        factor = self.rope_params().get("partial_rotary_factor", self.partial_rotary_factor)
        return int(self.head_size * float(factor if factor is not None else 0.5))


class Glm4Moe(Family[Glm4MoeConfig]):
    config_class = Glm4MoeConfig
    keep_fp32 = ROUTER_FP32

    def ignored(self, config: Glm4MoeConfig, name: str) -> bool:
        return past_last_layer(config.num_hidden_layers, name)  # the multi-token-prediction layer

    def build(self, config: Glm4MoeConfig) -> Decoder:
        c, rotary = config, config.rotary_dim()
        qk_norm = "head" if c.use_qk_norm else None

        def moe() -> MoeBlock:
            router = SigmoidTopK(c.k, c.norm_topk_prob, c.routed_scaling_factor, c.n_group, c.topk_group)
            shared = shared_experts(c.hidden_size, c.n_shared_experts, c.moe_width)
            return MoeBlock(c.hidden_size, c.n_experts, router, names=SCORED, shared=shared)

        return Decoder(c, lambda i: Attention.of(c, bias=c.attention_bias, qk_norm=qk_norm, rotary_dim=rotary),
                       c.rope(rotary), moe=moe)  # fmt: skip


FAMILY = Glm4Moe()
