"""dots.llm1 (`dots1`: dots.llm1.base, dots.llm1.inst): Qwen3's attention (GQA, per-head q/k RMSNorm before the rotary
embedding, `attention_bias` on q/k/v/o) with DeepSeek-V3's MoE (`routers.SigmoidTopK`: sigmoid router with a score
bias on the choice and group limits, weights renormalised when `norm_topk_prob` and scaled by `routed_scaling_factor`,
shared experts of `n_shared_experts * moe_intermediate_size`); dense layers below `first_k_dense_replace`, every later
layer MoE. Sliding-window layers as transformers reads them: `layer_types`, or else every layer from
`max_window_layers` on while `sliding_window` is set (their defaults, 4096 and 62, slide no layer of the released
62-layer models; a null window slides none).

Keys a config leaves out take transformers' defaults (no groups, weights not renormalised, a scale of 1, ...); a null
`n_group` / `topk_group` reads as no group limit (transformers 5.24 fails on it). Settings transformers ignores are
refused where they say otherwise (`moe_layer_freq` other than 1, a `scoring_func` other than sigmoid or a
`topk_method` other than "noaux_tc", sliding layers under `use_sliding_window: false`), and so is a config without
`n_shared_experts`, which transformers cannot build. The router stays in fp32 (`keep_fp32`), as the reference keeps
it."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import ROUTER_FP32, Family
from moelane.model.moe import SCORED, MoeBlock, shared_experts
from moelane.model.routers import SigmoidTopK, check_groups

KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True, kw_only=True)
class Dots1Config(Config):
    n_experts: int = key("n_routed_experts", "num_local_experts", low=1)  # (no default: transformers has none)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    n_shared_experts: int | None = key(default=None, low=0)
    n_group: int = key(default=1, low=1)
    topk_group: int = key(default=1, low=1)
    first_k_dense_replace: int = key(default=0, low=0)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    sliding_window: int | None = key(default=4096, keep_null=True, what=WINDOW)
    max_window_layers: int = 62
    layer_types: list[str] | None = None
    use_sliding_window: bool | None = None
    moe_layer_freq: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"

    def check(self) -> None:
        if self.n_shared_experts is None:
            raise ModelLoadError("dots1 needs n_shared_experts (transformers has no default for it)")
        if self.moe_layer_freq != 1:
            raise ModelLoadError(f"dots1 has MoE in every layer from first_k_dense_replace, got moe_layer_freq "
                                 f"{self.moe_layer_freq}")  # fmt: skip
        if (self.scoring_func, self.topk_method) != ("sigmoid", "noaux_tc"):
            raise ModelLoadError(f"dots1 routes with sigmoid scores and topk_method 'noaux_tc', got scoring_func "
                                 f"{self.scoring_func!r}, topk_method {self.topk_method!r}")  # fmt: skip
        check_groups(self.n_experts, self.top_k or 0, self.n_group, self.topk_group)
        self.windows()

    def moe_layers(self) -> list[int]:
        return list(range(self.first_k_dense_replace, self.num_hidden_layers))

    def windows(self) -> list[int | None]:
        """Per layer, its sliding window (None: full attention), as transformers reads the config."""
        n_layers, window = self.num_hidden_layers, self.sliding_window
        kinds = self.layer_types or [KINDS[window is not None and i >= self.max_window_layers] for i in range(n_layers)]
        if len(kinds) != n_layers or not set(kinds) <= set(KINDS):
            raise ModelLoadError(f"dots1 needs layer_types 'full_attention' or 'sliding_attention', one per layer "
                                 f"({n_layers}), got {kinds}")  # fmt: skip
        if "sliding_attention" in kinds:
            if window is None or window < 1:
                raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
            if self.use_sliding_window is False:
                raise ModelLoadError("dots1 with sliding layers but use_sliding_window false is not supported "
                                     "(transformers slides them, Qwen-style code would not)")  # fmt: skip
        return [window if kind == "sliding_attention" else None for kind in kinds]


class Dots1(Family[Dots1Config]):
    config_class = Dots1Config
    keep_fp32 = ROUTER_FP32

    def build(self, config: Dots1Config) -> Decoder:
        c, windows, bias = config, config.windows(), config.attention_bias

        def moe() -> MoeBlock:
            router = SigmoidTopK(c.k, c.norm_topk_prob, c.routed_scaling_factor, c.n_group, c.topk_group)
            shared = shared_experts(c.hidden_size, c.n_shared_experts, c.moe_width)
            return MoeBlock(c.hidden_size, c.n_experts, router, names=SCORED, shared=shared)

        return Decoder(c, lambda i: Attention.of(c, bias=bias, qk_norm="head", o_bias=bias, window=windows[i]),
                       c.rope(), moe=moe)  # fmt: skip


FAMILY = Dots1()
