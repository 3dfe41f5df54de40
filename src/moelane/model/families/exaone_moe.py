"""K-EXAONE (`exaone_moe`: K-EXAONE-236B-A23B): EXAONE 4's attention, GQA with per-head q/k RMSNorm and no biases,
in sliding-window layers that rotate and global layers that do not (no positional embedding at all: `layer_types`,
else every `sliding_window_pattern`-th layer global; transformers' config always has a window), with DeepSeek-V3's MoE
(`routers.SigmoidTopK`): sigmoid scores plus a learnt per-expert bias choose the experts within the `topk_group` best
of `n_group` groups, the unbiased scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`, weigh
them; shared experts of `num_shared_experts * moe_intermediate_size`; dense layers where `mlp_layer_types` says (else
below `first_k_dense_replace`). Pre-norm layers, as OLMoE's.

Keys a config leaves out take transformers' defaults (a 4,096-position window on three layers of four, a scale of
2.5, ...), and the per-layer lists are derived as transformers derives them. The router's weight and the score bias
beside it (`mlp.e_score_correction_bias`) stay in fp32 (`keep_fp32`), as the reference keeps them; the checkpoints'
multi-token-prediction tensors (`mtp.*`) are skipped, as transformers skips them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import Family
from moelane.model.moe import MoeBlock, Names, shared_experts
from moelane.model.routers import SigmoidTopK, check_groups

LAYER_KINDS, MLP_KINDS = ("sliding_attention", "full_attention"), ("dense", "sparse")  # (False, True) of each rule


@dataclass(frozen=True, slots=True, kw_only=True)
class ExaoneMoeConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    n_experts: int = key("num_experts", default=64, low=0)
    top_k: int | None = key("num_experts_per_tok", default=8)
    expert_width: int | None = key("moe_intermediate_size", default=1024, low=1)
    n_shared_experts: int | None = key("num_shared_experts", default=1, keep_null=True, low=0)  # null: none
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_group: int = key(default=1, low=1)
    topk_group: int = key(default=1, low=1)
    sliding_window: int | None = key(default=4096, keep_null=True, what=WINDOW)
    sliding_window_pattern: int | str | None = 4
    first_k_dense_replace: int = key(default=1, low=0)
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None

    def check(self) -> None:
        window = self.sliding_window
        if window is None or window < 1:  # (transformers' config: an int)
            raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
        self.sliding()
        check_groups(self.n_experts, self.top_k or 0, self.n_group, self.topk_group)

    def sliding(self) -> list[bool]:
        """Per layer, whether it slides (and rotates), else it is global (no positional embedding)."""
        kinds, pattern = self.layer_types, self.sliding_window_pattern
        if kinds is None:  # (as transformers derives them; a pattern string such as "LLLG" it cannot)
            if isinstance(pattern, str) or pattern is None or pattern < 1:
                raise ModelLoadError(f"exaone_moe without layer_types needs a whole-number sliding_window_pattern, "
                                     f"got {pattern!r}")  # fmt: skip
            kinds = [LAYER_KINDS[(i + 1) % pattern == 0] for i in range(self.num_hidden_layers)]
        return [kind == "sliding_attention" for kind in self.kinds("layer_types", kinds, LAYER_KINDS)]

    def moe_layers(self) -> list[int]:
        kinds = self.mlp_layer_types
        if kinds is None:
            kinds = [MLP_KINDS[i >= self.first_k_dense_replace] for i in range(self.num_hidden_layers)]
        return [i for i, kind in enumerate(self.kinds("mlp_layer_types", kinds, MLP_KINDS)) if kind == "sparse"]

    def kinds(self, name: str, kinds: list[str], allowed: tuple[str, str]) -> list[str]:
        n_layers = self.num_hidden_layers
        if len(kinds) != n_layers or not set(kinds) <= set(allowed):
            raise ModelLoadError(f"exaone_moe needs {name}, one of {allowed} per layer ({n_layers}), got {kinds!r}")
        return kinds


class NoPositionAttention(Attention):
    """EXAONE's global layers: queries and keys are not rotated."""

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class ExaoneMoe(Family[ExaoneMoeConfig]):
    config_class = ExaoneMoeConfig
    keep_fp32 = ("mlp.gate.weight", "mlp.e_score_correction_bias")

    def ignored(self, config: ExaoneMoeConfig, name: str) -> bool:
        return "mtp" in name  # the multi-token-prediction tensors, as transformers' `mtp.*`

    def build(self, config: ExaoneMoeConfig) -> Decoder:
        c, sliding = config, config.sliding()

        def attention(i: int) -> Attention:
            if sliding[i]:
                return Attention.of(c, qk_norm="head", window=c.sliding_window)
            return NoPositionAttention.of(c, qk_norm="head")

        def moe() -> MoeBlock:
            router = SigmoidTopK(c.k, c.norm_topk_prob, c.routed_scaling_factor, c.n_group, c.topk_group)
            shared = shared_experts(c.hidden_size, c.n_shared_experts, c.moe_width)
            names = Names(score_bias="e_score_correction_bias")  # (beside the router)
            return MoeBlock(c.hidden_size, c.n_experts, router, names=names, shared=shared)

        return Decoder(c, attention, c.rope(), moe=moe)


FAMILY = ExaoneMoe()
