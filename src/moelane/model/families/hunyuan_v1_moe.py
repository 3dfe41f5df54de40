"""Hunyuan MoE (`hunyuan_v1_moe`: Hunyuan-A13B-Instruct): GQA with per-head q/k RMSNorm applied after the rotary
embedding (`query_layernorm` / `key_layernorm`), `attention_bias` on all four projections; every layer MoE, a softmax
router (`mlp.gate.wg`, kept in fp32 as the reference keeps it) whose top-k weights are always renormalised, plus one
always-on shared MLP (`mlp.shared_mlp`) as wide as the experts (`intermediate_size`). Rope "dynamic" with an `alpha`
(NTK-alpha) only raises the base, to `rope_theta * alpha ** (d / (d - 2))`, whatever the length.

Tencent's configs give some keys per layer (`moe_topk`, `num_experts`, ...): lists of one value read as that value,
lists whose values differ are refused, and so are the keys of Tencent's own code that transformers 5.24 ignores
(cross-layer attention `use_cla`, a shared MLP off or of other widths, `mlp_bias`, no q/k norm): a checkpoint that
needs them would not compute what it was trained to."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import Family
from moelane.model.layers import MLP, RMSNorm
from moelane.model.moe import MoeBlock, Names
from moelane.model.rope import Rope, apply_rope
from moelane.model.routers import SoftmaxTopK

PER_LAYER = ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert")


@dataclass(frozen=True, slots=True, kw_only=True)
class HunyuanV1MoeConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    n_experts: int = key("num_experts", default=1, low=0)
    top_k: int | None = key("moe_topk", default=1)
    expert_width: int | None = key("intermediate_size", default=None, low=1)
    moe_intermediate_size: int | None = None
    attention_bias: bool = False
    use_cla: bool = False
    mlp_bias: bool = False
    use_qk_norm: bool = True
    use_mixed_mlp_moe: bool = True
    num_shared_expert: int = 1

    @classmethod
    def prepare(cls, d: Mapping[str, Any]) -> Mapping[str, Any]:
        """Per-layer lists of one value read as that value."""
        out = dict(d)
        for name in PER_LAYER:
            if isinstance(out.get(name), list):
                if len(set(out[name])) != 1:
                    raise ModelLoadError(f"hunyuan_v1_moe with per-layer {name} that differ is not supported: "
                                         f"{out[name]}")  # fmt: skip
                out[name] = out[name][0]
        return out

    def check(self) -> None:
        if self.use_cla or self.mlp_bias or not self.use_qk_norm:
            raise ModelLoadError("hunyuan_v1_moe with use_cla, mlp_bias or no use_qk_norm is not supported")
        if not self.use_mixed_mlp_moe or self.num_shared_expert != 1:
            raise ModelLoadError("hunyuan_v1_moe needs one shared MLP (use_mixed_mlp_moe, num_shared_expert 1)")
        width = self.moe_intermediate_size
        if width is not None and width != self.expert_width:
            raise ModelLoadError(f"hunyuan_v1_moe needs moe_intermediate_size == intermediate_size, got {width}")
        if self.n_experts < 1:
            raise ModelLoadError("hunyuan_v1_moe needs num_experts >= 1")

    def rope(self, dim: int | None = None) -> Rope:
        params, dim = self.rope_params(), dim or self.head_size
        if params["rope_type"] == "dynamic" and params.get("alpha"):  # NTK-alpha: a fixed larger base
            base = float(params["rope_theta"]) * float(params["alpha"]) ** (dim / (dim - 2))
            params = {"rope_theta": base, "rope_type": "default"}
        return Rope.build(params, dim, self.max_position_embeddings)


class NormAfterRopeAttention(Attention):
    """GQA whose per-head q/k RMSNorms come after the rotary embedding."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        eps = kwargs["eps"]
        self.query_layernorm, self.key_layernorm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_layernorm(apply_rope(q, cos, sin)), self.key_layernorm(apply_rope(k, cos, sin))


class HunyuanV1Moe(Family[HunyuanV1MoeConfig]):
    config_class = HunyuanV1MoeConfig
    keep_fp32 = ("mlp.gate.wg.weight",)

    def build(self, config: HunyuanV1MoeConfig) -> Decoder:
        c, bias = config, config.attention_bias
        router = SoftmaxTopK(c.k, norm=True, precision="fp32")
        names = Names(gate="gate.wg", shared="shared_mlp")

        def moe() -> MoeBlock:
            return MoeBlock(c.hidden_size, c.n_experts, router, names=names, shared=MLP(c.hidden_size, c.moe_width))

        return Decoder(c, lambda i: NormAfterRopeAttention.of(c, bias=bias, o_bias=bias), c.rope(), moe=moe)


FAMILY = HunyuanV1Moe()
