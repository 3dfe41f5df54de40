"""ERNIE 4.5 MoE (`ernie4_5_moe`: ERNIE-4.5-21B-A3B-PT, ERNIE-4.5-300B-A47B-PT): GQA rotating interleaved pairs in
fp32 (`rope.rotate_pairs`, `rope.Fp32Rope`); a softmax router in fp32 whose top-k choice adds a learnt per-expert bias
(`mlp.moe_statics.e_score_correction_bias`) to the probabilities, weighing by the unbiased ones renormalised over a sum
clamped to `moe_norm_min`; a shared expert MLP of `moe_num_shared_experts * moe_intermediate_size`; MoE layers every
`moe_layer_interval`-th from `moe_layer_start_index` to `moe_layer_end_index`. `use_bias` gives every projection a
bias, the LM head's too (not the experts' or the router's); embeddings tied unless the config says not.

Keys a config leaves out take transformers' defaults; `moe_num_experts` / `moe_k` may also be spelt `num_experts` /
`num_experts_per_tok`. The router stays in fp32 (`keep_fp32`), as the reference keeps it; the multi-token-prediction
tensors (`mtp`) are skipped, as transformers skips them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelane.model.attention import Attention
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder, DenseMlp, dense_width
from moelane.model.family import Family
from moelane.model.moe import MoeBlock, Names, shared_experts
from moelane.model.rope import Fp32Rope, rotate_pairs
from moelane.model.routers import Gate, biased_group_topk, router_logits


@dataclass(frozen=True, slots=True, kw_only=True)
class Ernie45MoeConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=131072, low=1)
    tie_word_embeddings: bool = True
    rope_theta: float = 500000.0
    n_experts: int = key("moe_num_experts", "num_experts", default=64, low=0)
    top_k: int | None = key("moe_k", "num_experts_per_tok", default=6)
    expert_width: int | None = key("moe_intermediate_size", default=1536, low=1)
    moe_num_shared_experts: int = key(default=2, low=0)
    moe_norm_min: float = 1e-12
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1  # -1: the last layer, as transformers reads it (no other count from the end)
    moe_layer_interval: int = key(default=1, low=1)
    use_bias: bool = False

    def moe_layers(self) -> list[int]:
        n_layers, start, interval = self.num_hidden_layers, self.moe_layer_start_index, self.moe_layer_interval
        end = n_layers - 1 if self.moe_layer_end_index == -1 else self.moe_layer_end_index
        return [i for i in range(n_layers) if self.n_experts > 0 and (i + 1) % interval == 0 and start <= i <= end]


@dataclass(frozen=True, slots=True)
class ErnieRouter:
    """Softmax probabilities of the router in fp32 choose by `probs + score_bias`; the unbiased ones weigh,
    renormalised over a sum clamped to `norm_min`, rounded to the model's dtype as transformers' router gives them."""

    k: int
    norm_min: float

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        assert gate.score_bias is not None
        probs = torch.softmax(router_logits(x, gate, "fp32"), dim=-1)
        weights, ids = biased_group_topk(probs, gate.score_bias.float()[0], self.k)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(x.dtype), ids


class PairRopeAttention(Attention):
    """GQA without q/k norms or windows, rotating interleaved pairs (queries and keys come out in halves order)."""

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)


class Ernie45Moe(Family[Ernie45MoeConfig]):
    config_class = Ernie45MoeConfig
    keep_fp32 = ("mlp.gate.weight", "mlp.moe_statics.e_score_correction_bias")

    def ignored(self, config: Ernie45MoeConfig, name: str) -> bool:
        return "mtp" in name  # the multi-token-prediction block (`model.mtp_*`)

    def build(self, config: Ernie45MoeConfig) -> Decoder:
        c, bias = config, config.use_bias
        names = Names(score_bias="moe_statics.e_score_correction_bias")

        def moe() -> MoeBlock:
            shared = shared_experts(c.hidden_size, c.moe_num_shared_experts, c.moe_width, bias)
            return MoeBlock(c.hidden_size, c.n_experts, ErnieRouter(c.k, c.moe_norm_min), names=names, shared=shared,
                            score_bias_shape=(1, c.n_experts))  # fmt: skip

        rope = Fp32Rope.build(c.rope_params(), c.head_size, c.max_position_embeddings)
        model = Decoder(c, lambda i: PairRopeAttention.of(c, bias=bias, o_bias=bias), rope, moe=moe,
                        dense=lambda: DenseMlp(c.hidden_size, dense_width(c), bias))  # fmt: skip
        if bias:  # (the LM head's too: `Decoder.logits` adds it)
            model.lm_head.bias = torch.nn.Parameter(torch.zeros(c.vocab_size))
        return model


FAMILY = Ernie45Moe()
