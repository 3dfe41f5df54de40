"""IBM Granite MoE (`granitemoe`: granite-3.0-1b-a400m, granite-3.0-3b-a800m, granite-3.1-1b-a400m,
granite-3.1-3b-a800m, base and instruct; `granitemoeshared`, read by this module too): Llama-style GQA whose softmax
scale is `attention_multiplier` instead of 1/sqrt(head_dim), and three multipliers the shared decoder does not have
(`GraniteDecoder`): the embeddings times `embedding_multiplier`, each block's output times `residual_multiplier`
before it joins the residual stream, the logits divided by `logits_scaling`. Every layer is MoE: the router
(`router.layer`, its logits taken to fp32) picks the top k logits and softmaxes over those k alone
(`routers.TopKSoftmax`); the experts are SwiGLU, stored stacked: `block_sparse_moe.input_linear.weight` [E, 2I, H]
(gate rows, then up rows) and `output_linear.weight` [E, H, I], each expert read as its slice of them.

`granitemoeshared` adds, in every layer, an always-on SwiGLU of `shared_intermediate_size` (0, transformers'
default, means none) stored fused as the experts are (`shared_mlp.input_linear`, gate rows first, and
`shared_mlp.output_linear`), whose output is added to the experts' before the residual multiplier scales their sum.
Every multiplier a config leaves out is 1 (so a softmax scale of 1 too), as in transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention, Batch
from moelane.model.checkpoint import ExpertHandle, TensorRef, renamed, stacked_experts
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder, DecoderLayer
from moelane.model.family import Family
from moelane.model.layers import FusedMLP, linear
from moelane.model.moe import MoeBlock, Names, Routing
from moelane.model.provider import ExpertProvider
from moelane.model.routers import TopKSoftmax

T = TypeVar("T")
EXPERT_NAMES = {"gate_up": "input_linear.weight", "down": "output_linear.weight"}
RENAMES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"^(model\.layers\.\d+)\.shared_mlp\."), r"\1.mlp.shared_mlp."),  # (beside the block: into it)
]


@dataclass(frozen=True, slots=True, kw_only=True)
class GraniteMoeConfig(Config):
    n_experts: int = key("num_local_experts", default=8, low=0)
    top_k: int | None = key("num_experts_per_tok", default=2)
    expert_width: int | None = key("intermediate_size", default=None, low=1)
    shared_intermediate_size: int = 0
    attention_bias: bool = False
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def check(self) -> None:
        if self.shared_intermediate_size < 0:
            raise ModelLoadError(f"{self.model_type} needs shared_intermediate_size a whole number >= 0, got "
                                 f"{self.shared_intermediate_size!r}")  # fmt: skip
        if not self.logits_scaling:
            raise ModelLoadError(f"{self.model_type} needs logits_scaling != 0 (the logits are divided by it)")
        if self.n_experts < 1:
            raise ModelLoadError(f"{self.model_type} needs num_local_experts >= 1 (every layer is MoE)")


class GraniteDecoder(Decoder):
    """The shared decoder with Granite's multipliers on the embeddings, on each block's output and on the logits,
    applied in the model's dtype as the reference applies them."""

    def __init__(self, config: GraniteMoeConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.embedding_multiplier, self.residual_multiplier = config.embedding_multiplier, config.residual_multiplier
        self.logits_scaling = config.logits_scaling

    def forward(self, tokens: torch.Tensor, batch: Batch, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        x = self.model.embed_tokens(tokens) * self.embedding_multiplier
        rope, scale = self.rope.cos_sin(batch.positions, x.dtype), self.residual_multiplier
        for i, layer in enumerate(cast(list[DecoderLayer], self.model.layers)):
            x = x + layer.self_attn(layer.input_layernorm(x), i, batch, rope) * scale
            x = x + layer.mlp(layer.post_attention_layernorm(x), i, provider, routing) * scale
        return cast(torch.Tensor, self.model.norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (linear(hidden, self.lm_head.weight, exact_out=True) / self.logits_scaling).float()


class GraniteMoe(Family[GraniteMoeConfig]):
    config_class = GraniteMoeConfig

    def expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.block_sparse_moe"

    def find_experts(
        self, refs: dict[str, TensorRef], prefix: str, n_experts: int, fp8_block: tuple[int, int] | None
    ) -> list[ExpertHandle] | None:
        return stacked_experts(refs, prefix, EXPERT_NAMES, n_experts)

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        return renamed(weights, RENAMES)

    def build(self, config: GraniteMoeConfig) -> Decoder:
        c, bias, width = config, config.attention_bias, config.shared_intermediate_size
        router = TopKSoftmax(c.k, precision="scores", round_weights=True)
        names = Names(gate="router.layer", shared="shared_mlp")

        def attention(i: int) -> Attention:
            attention = Attention.of(c, bias=bias, o_bias=bias)
            attention.scale = c.attention_multiplier  # (in place of 1/sqrt(head_dim))
            return attention

        def moe() -> MoeBlock:
            shared = FusedMLP(c.hidden_size, width) if width else None
            return MoeBlock(c.hidden_size, c.n_experts, router, names=names, shared=shared)

        return GraniteDecoder(c, attention, c.rope(), moe=moe)


FAMILY = GraniteMoe()
