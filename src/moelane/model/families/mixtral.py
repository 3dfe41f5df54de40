"""Mixtral (8x7B, 8x22B): Llama-style GQA without biases; every layer MoE with a softmax top-k router whose top-k
weights are always renormalised (and stay fp32); experts named `block_sparse_moe.experts.N.w1/w3/w2` (gate/up/down),
the router `block_sparse_moe.gate` (the decoder's `mlp.gate`). `sliding_window`, when set, applies to every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder, sliding_windows
from moelane.model.family import W1_W3_W2, Family
from moelane.model.moe import MoeBlock
from moelane.model.routers import SoftmaxTopK

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class MixtralConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=32768, low=1)
    rope_theta: float = 1e6
    n_experts: int = key("num_local_experts", "num_experts", low=1)
    top_k: int | None = key("num_experts_per_tok", default=None)
    expert_width: int | None = key("intermediate_size", default=None, low=1)
    sliding_window: int | None = key(default=None, what=WINDOW)

    def check(self) -> None:
        sliding_windows(self.num_hidden_layers, self.sliding_window)


class Mixtral(Family[MixtralConfig]):
    config_class = MixtralConfig
    expert_names = W1_W3_W2

    def expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.block_sparse_moe.experts"

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        return {name.replace(".block_sparse_moe.", ".mlp."): w for name, w in weights.items()}

    def build(self, config: MixtralConfig) -> Decoder:
        windows = sliding_windows(config.num_hidden_layers, config.sliding_window)
        router = SoftmaxTopK(config.k, norm=True)
        return Decoder(config, lambda i: Attention.of(config, window=windows[i]), config.rope(),
                       moe=lambda: MoeBlock(config.hidden_size, config.n_experts, router))  # fmt: skip


FAMILY = Mixtral()
