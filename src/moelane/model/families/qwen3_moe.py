"""Qwen3-MoE (Qwen3-30B-A3B and kin): GQA with per-head q/k RMSNorm, a softmax top-k router whose weights are rounded
to the model's dtype, optionally renormalised (`norm_topk_prob`), dense layers where `mlp_only_layers` /
`decoder_sparse_step` say so. No sliding window: the released checkpoints have none, and a config that sets
`use_sliding_window` is refused, since implementations disagree on which layers it applies to (transformers 5.24
windows every layer and ignores `max_window_layers`)."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder, sparse_layers
from moelane.model.family import Family
from moelane.model.moe import MoeBlock
from moelane.model.routers import SoftmaxTopK


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3MoeConfig(Config):
    max_position_embeddings: int = key(default=32768, low=1)
    n_experts: int = key("num_experts", "num_local_experts", low=1)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    norm_topk_prob: bool = False
    attention_bias: bool = False
    mlp_only_layers: list[int] | None = None
    decoder_sparse_step: int = key(default=1, low=1)
    use_sliding_window: bool = False
    sliding_window: int | None = key(default=None, what=WINDOW)

    def check(self) -> None:
        if self.use_sliding_window and self.sliding_window:
            raise ModelLoadError("qwen3_moe with use_sliding_window is not supported (which layers slide is not "
                                 "agreed)")  # fmt: skip

    def moe_layers(self) -> list[int]:
        return sparse_layers(self.num_hidden_layers, self.decoder_sparse_step, self.mlp_only_layers)


class Qwen3Moe(Family[Qwen3MoeConfig]):
    config_class = Qwen3MoeConfig

    def build(self, config: Qwen3MoeConfig) -> Decoder:
        bias, router = config.attention_bias, SoftmaxTopK(config.k, config.norm_topk_prob, round_weights=True)
        return Decoder(
            config, lambda i: Attention.of(config, bias=bias, qk_norm="head", o_bias=bias), config.rope(),
            moe=lambda: MoeBlock(config.hidden_size, config.n_experts, router),
        )  # fmt: skip


FAMILY = Qwen3Moe()
