"""DeepSeek-V2 (V2, V2-Lite, V2.5): multi-head latent attention (`latent.LatentAttention`, rotary dims in interleaved
pairs, rotated in fp32), shared experts, group-limited routing.

Routing: softmax over experts (the router's weight kept in fp32, as the reference keeps it), top-k `greedy` or
`group_limited_greedy` (keep the `topk_group` groups of `n_group` with the best single expert, then top-k among
them). As in DeepSeek's own code, weights are renormalised when `norm_topk_prob` (and k > 1), otherwise multiplied by
`routed_scaling_factor` (transformers 5.24 always scales and ignores `norm_topk_prob`; the released checkpoints have
it false, where both agree). `n_shared_experts` always-on experts (one MLP of `n_shared_experts *
moe_intermediate_size`) are added. Layers below `first_k_dense_replace` are dense, and above it every
`moe_layer_freq`-th.

A config without `n_shared_experts` gets transformers' default (2), so a checkpoint that does not match it is refused
(missing tensors) instead of loading with its shared experts ignored; an explicit null means none, as in DeepSeek's
code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelane.errors import ModelLoadError
from moelane.model.config import key
from moelane.model.decoder import Decoder
from moelane.model.family import ROUTER_FP32, Family
from moelane.model.latent import LatentConfig, check_latent, deepseek_moe_layers, latent_decoder
from moelane.model.moe import MoeBlock, shared_experts
from moelane.model.routers import Gate, router_logits

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepseekV2Config(LatentConfig):
    n_experts: int = key("n_routed_experts", "num_experts", default=0, low=0)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    n_shared_experts: int | None = key(default=2, keep_null=True, low=0)
    topk_method: str = "greedy"
    n_group: int | None = key(default=None, low=1)
    topk_group: int | None = key(default=None, low=1)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = key(default=0, low=0)
    moe_layer_freq: int = key(default=1, low=1)

    def check(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ModelLoadError(f"unsupported topk_method {self.topk_method!r} (supported: {', '.join(TOPK_METHODS)})")
        if self.topk_method == "group_limited_greedy":
            n_group, topk_group = self.n_group or 0, self.topk_group or 0
            if n_group < 1 or self.n_experts % n_group or not 1 <= topk_group <= n_group:
                raise ModelLoadError(
                    f"group_limited_greedy needs n_group dividing {self.n_experts} experts and "
                    f"1 <= topk_group <= n_group, got n_group={n_group}, topk_group={topk_group}"
                )
        check_latent(self)

    def moe_layers(self) -> list[int]:
        return deepseek_moe_layers(self.num_hidden_layers, self.n_experts, self.first_k_dense_replace,
                                   self.moe_layer_freq)  # fmt: skip


@dataclass(frozen=True, slots=True)
class GroupLimitedSoftmax:
    """Softmax scores of the router in fp32 [T, E]; the top k of all experts ("greedy") or of the `topk_group`
    groups whose best expert scores highest ("group_limited_greedy"); renormalised when `norm`, else scaled."""

    k: int
    method: str
    n_group: int
    topk_group: int
    norm: bool
    scaling: float

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.softmax(router_logits(x, gate, "fp32"), dim=-1, dtype=torch.float32)
        if self.method == "group_limited_greedy":
            n_tokens, n_experts = scores.shape
            best = scores.view(n_tokens, self.n_group, n_experts // self.n_group).amax(dim=-1)  # [T, G]
            keep = torch.zeros_like(best).scatter_(1, torch.topk(best, self.topk_group, dim=-1).indices, 1.0)
            scores = scores.masked_fill(keep.repeat_interleave(n_experts // self.n_group, dim=1) == 0, 0.0)
        weights, ids = torch.topk(scores, self.k, dim=-1)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) if self.norm else weights * self.scaling, ids


class DeepseekV2(Family[DeepseekV2Config]):
    config_class = DeepseekV2Config
    keep_fp32 = ROUTER_FP32  # (as transformers keeps the router's weight)

    def build(self, config: DeepseekV2Config) -> Decoder:
        c = config

        def moe() -> MoeBlock:
            router = GroupLimitedSoftmax(c.k, c.topk_method, c.n_group or 1, c.topk_group or 1,
                                         c.norm_topk_prob and c.k > 1, c.routed_scaling_factor)  # fmt: skip
            shared = shared_experts(c.hidden_size, c.n_shared_experts, c.moe_width, c.mlp_bias)
            return MoeBlock(c.hidden_size, c.n_experts, router, shared=shared)

        return latent_decoder(c, moe, torch.float32, interleave=True)


FAMILY = DeepseekV2()
