"""OLMoE (OLMoE-1B-7B): GQA with RMSNorm over the whole q and k projections (not per head), optional `clip_qkv`
clamping of q/k/v, `attention_bias` on all four projections; every layer MoE with a softmax top-k router whose
weights are rounded to the model's dtype, optionally renormalised (`norm_topk_prob`, off in the released
checkpoints). Expert width is `intermediate_size`."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.model.attention import Attention
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import Family
from moelane.model.moe import MoeBlock
from moelane.model.routers import SoftmaxTopK


@dataclass(frozen=True, slots=True, kw_only=True)
class OlmoeConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=4096, low=1)
    n_experts: int = key("num_experts", "num_local_experts", low=1)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("intermediate_size", default=None, low=1)
    norm_topk_prob: bool = False
    attention_bias: bool = False
    clip_qkv: float | None = None


class Olmoe(Family[OlmoeConfig]):
    config_class = OlmoeConfig

    def build(self, config: OlmoeConfig) -> Decoder:
        bias, router = config.attention_bias, SoftmaxTopK(config.k, config.norm_topk_prob, round_weights=True)
        return Decoder(
            config, lambda i: Attention.of(config, bias=bias, qk_norm="full", o_bias=bias, clip=config.clip_qkv),
            config.rope(), moe=lambda: MoeBlock(config.hidden_size, config.n_experts, router),
        )  # fmt: skip


FAMILY = Olmoe()
