"""Llama (2, 3, 3.1, 3.2) and other dense Llama-shaped models: GQA, `attention_bias` on q/k/v/o, `mlp_bias`,
Llama 3.1 rope scaling; no sliding window (transformers ignores `sliding_window` for Llama). No experts."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.model.attention import Attention
from moelane.model.config import Config
from moelane.model.decoder import Decoder, DenseMlp, dense_width
from moelane.model.family import Family


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig(Config):
    attention_bias: bool = False
    mlp_bias: bool = False


class Llama(Family[LlamaConfig]):
    config_class = LlamaConfig

    def build(self, config: LlamaConfig) -> Decoder:
        bias = config.attention_bias
        return Decoder(config, lambda i: Attention.of(config, bias=bias, o_bias=bias), config.rope(),
                       dense=lambda: DenseMlp(config.hidden_size, dense_width(config), config.mlp_bias))  # fmt: skip


FAMILY = Llama()
