"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's multi-head latent attention (`latent.LatentAttention`, rotary dims
in interleaved pairs unless `rope_interleave` is false, in the model's dtype) with GLM-4.5's MoE (`routers.SigmoidTopK`:
sigmoid router with a score bias on the choice and group limits, weights renormalised when `norm_topk_prob` and scaled
by `routed_scaling_factor`; one shared expert MLP). What it has of its own: which layers are MoE is `mlp_layer_types`
("dense" / "sparse", one per layer; by default the first dense, the rest sparse), and its defaults (a 768-rank
low-rank query, a scale of 1.8, ...).

transformers 5.24 reads only `mlp_layer_types`: the hub configs' `first_k_dense_replace` (1) is refused where it says
otherwise, and so are settings transformers ignores or cannot compute (`mlp_bias`, a `topk_method` other than
"noaux_tc", a `partial_rotary_factor` other than 1: the rotary dims are all `qk_rope_head_dim`). The router stays in
fp32 (`keep_fp32`), as the reference keeps it; the multi-token-prediction layer (`model.layers.{num_hidden_layers}`)
is skipped."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.errors import ModelLoadError
from moelane.model.config import key
from moelane.model.decoder import Decoder
from moelane.model.family import ROUTER_FP32, Family, past_last_layer
from moelane.model.latent import LatentConfig, check_latent, latent_decoder
from moelane.model.moe import SCORED, MoeBlock, shared_experts
from moelane.model.routers import SigmoidTopK, check_groups


@dataclass(frozen=True, slots=True, kw_only=True)
class Glm4MoeLiteConfig(LatentConfig):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=202752, low=1)
    q_lora_rank: int | None = key(default=768, keep_null=True, low=1)
    n_experts: int = key("n_routed_experts", "num_local_experts", default=64, low=0)
    top_k: int | None = key("num_experts_per_tok", default=4)
    expert_width: int | None = key("moe_intermediate_size", default=None, low=1)
    n_shared_experts: int | None = key(default=1, keep_null=True, low=0)  # null: none
    n_group: int = key(default=1, low=1)
    topk_group: int = key(default=1, low=1)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.8
    rope_interleave: bool = True
    mlp_layer_types: list[str] | None = None
    first_k_dense_replace: int | None = key(default=None, low=0)
    topk_method: str = "noaux_tc"
    partial_rotary_factor: float | None = None

    def check(self) -> None:
        partial = self.rope_params().get("partial_rotary_factor", self.partial_rotary_factor)
        if partial not in (None, 1, 1.0):
            raise ModelLoadError(f"glm4_moe_lite turns all qk_rope_head_dim dims, got partial_rotary_factor {partial}")
        if self.mlp_bias:
            raise ModelLoadError("glm4_moe_lite with mlp_bias is not supported (transformers ignores it)")
        if self.topk_method != "noaux_tc":
            raise ModelLoadError(f"glm4_moe_lite routes with topk_method 'noaux_tc', got {self.topk_method!r}")
        check_latent(self)
        check_groups(self.n_experts, self.top_k or 0, self.n_group, self.topk_group)

    def moe_layers(self) -> list[int]:
        """The layers `mlp_layer_types` marks "sparse" (by default all but the first), checked against a
        `first_k_dense_replace` the config also gives."""
        n_layers = self.num_hidden_layers
        kinds = self.mlp_layer_types or ["dense"] + ["sparse"] * (n_layers - 1)
        if len(kinds) != n_layers or not set(kinds) <= {"dense", "sparse"}:
            raise ModelLoadError(f"glm4_moe_lite needs mlp_layer_types 'dense' or 'sparse', one per layer "
                                 f"({n_layers}), got {kinds}")  # fmt: skip
        first_dense = self.first_k_dense_replace
        if first_dense is not None and kinds != ["dense"] * first_dense + ["sparse"] * (n_layers - first_dense):
            raise ModelLoadError(f"glm4_moe_lite's first_k_dense_replace {first_dense} contradicts mlp_layer_types "
                                 f"{kinds} (transformers reads only mlp_layer_types)")  # fmt: skip
        return [i for i, kind in enumerate(kinds) if kind == "sparse"]


class Glm4MoeLite(Family[Glm4MoeLiteConfig]):
    config_class = Glm4MoeLiteConfig
    keep_fp32 = ROUTER_FP32

    def ignored(self, config: Glm4MoeLiteConfig, name: str) -> bool:
        return past_last_layer(config.num_hidden_layers, name)  # the multi-token-prediction layer

    def build(self, config: Glm4MoeLiteConfig) -> Decoder:
        c = config

        def moe() -> MoeBlock:
            router = SigmoidTopK(c.k, c.norm_topk_prob, c.routed_scaling_factor, c.n_group, c.topk_group)
            shared = shared_experts(c.hidden_size, c.n_shared_experts, c.moe_width)
            return MoeBlock(c.hidden_size, c.n_experts, router, names=SCORED, shared=shared)

        return latent_decoder(c, moe, None, c.rope_interleave)


FAMILY = Glm4MoeLite()
