"""MiniMax-M2 (`minimax_m2`: MiniMax-M2, M2.1, M2.5): GQA whose q/k RMSNorms run over the whole projection, every head
at once (`qk_norm_type` "per_layer", as OLMoE's), before the rotary embedding turns the first `rotary_dim` dims of each
head (Llama-style halves); every layer MoE, a sigmoid router whose top-k choice adds a learnt per-expert bias
(`e_score_correction_bias`, beside the router) while the weights are the unbiased scores renormalised to sum 1; no
shared expert. Checkpoint names are Mixtral's (`block_sparse_moe.gate`, experts `w1/w3/w2`), read as Mixtral's are.

The router computes in the model's dtype and only its sigmoid in fp32, as transformers computes it (vLLM and SGLang
keep it in fp32; the two agree in fp32). Keys a config leaves out take transformers' defaults (a head of 128 dims, not
hidden / heads); the keys of MiniMax's own code that transformers 5.24 ignores are refused where they ask for
something else (per-head q/k norms, no q/k norm, another scoring function, no routing bias, shared experts,
lightning-attention layers): a checkpoint that needs them would not compute what it was trained to. The
multi-token-prediction layers (`model.layers.{num_hidden_layers + i}`, `num_mtp_modules`) are skipped, as transformers
skips them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import W1_W3_W2, Family, past_last_layer
from moelane.model.moe import MoeBlock, Names
from moelane.model.routers import SigmoidTopK

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class MiniMaxM2Config(Config):
    head_dim: int | None = key(default=128, low=1)
    max_position_embeddings: int = key(default=196608, low=1)
    rope_theta: float = 5e6
    n_experts: int = key("num_local_experts", "num_experts", default=256, low=0)
    top_k: int | None = key("num_experts_per_tok", default=8)
    expert_width: int | None = key("intermediate_size", default=1536, low=1)
    rotary_dim: int | None = key(default=None, low=0)
    partial_rotary_factor: float | None = None
    use_qk_norm: bool = True
    qk_norm_type: str = "per_layer"
    scoring_func: str = "sigmoid"
    use_routing_bias: bool = True
    shared_intermediate_size: int = 0
    attn_type_list: list[int] | None = None

    def check(self) -> None:
        if not self.use_qk_norm or self.qk_norm_type != "per_layer":
            raise ModelLoadError(f"minimax_m2 needs q/k norms over the whole projection (use_qk_norm, qk_norm_type "
                                 f"'per_layer'), got {self.use_qk_norm}, {self.qk_norm_type!r}")  # fmt: skip
        if self.scoring_func != "sigmoid" or not self.use_routing_bias:
            raise ModelLoadError("minimax_m2 routes by sigmoid scores with a routing bias (scoring_func 'sigmoid', "
                                 "use_routing_bias)")  # fmt: skip
        if self.shared_intermediate_size or any(kind != 1 for kind in self.attn_type_list or []):
            raise ModelLoadError("minimax_m2 with shared experts (shared_intermediate_size) or lightning-attention "
                                 "layers (attn_type_list 0) is not supported")  # fmt: skip
        if self.n_experts < 1:
            raise ModelLoadError("minimax_m2 needs num_local_experts >= 1")
        self.rotary_dims()

    def rotary_dims(self) -> int:
        """The dims of each head that rotate: `partial_rotary_factor` (of the rope parameters, else the top level),
        else the released configs' `rotary_dim`, else the whole head; as transformers reads them."""
        head = self.head_size
        factor = self.rope_params().get("partial_rotary_factor", self.partial_rotary_factor)
        if factor is None:
            factor = self.rotary_dim / head if self.rotary_dim is not None else 1.0
        rotary = int(head * float(factor))
        if not 0 < rotary <= head or rotary % 2:
            raise ModelLoadError(f"minimax_m2 rotates {rotary} dims of a head's {head} (rotary_dim, partial_rotary_"
                                 "factor); they must be an even number from 2 to the head's")  # fmt: skip
        return rotary


class MiniMaxM2(Family[MiniMaxM2Config]):
    config_class = MiniMaxM2Config
    expert_names = W1_W3_W2

    def expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.block_sparse_moe.experts"

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        return {name.replace(".block_sparse_moe.", ".mlp."): w for name, w in weights.items()}

    def ignored(self, config: MiniMaxM2Config, name: str) -> bool:
        return past_last_layer(config.num_hidden_layers, name)  # the multi-token-prediction layers

    def build(self, config: MiniMaxM2Config) -> Decoder:
        c, rotary = config, config.rotary_dims()
        router = SigmoidTopK(c.k, norm=True, eps=0.0, precision="scores")
        names = Names(score_bias="e_score_correction_bias")
        return Decoder(c, lambda i: Attention.of(c, qk_norm="full", rotary_dim=rotary), c.rope(rotary),
                       moe=lambda: MoeBlock(c.hidden_size, c.n_experts, router, names=names))  # fmt: skip


FAMILY = MiniMaxM2()
