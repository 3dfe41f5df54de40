"""Qwen3 dense (Qwen3-0.6B ... 32B; the shipped draft model): Llama-shaped with per-head q/k RMSNorm and
`attention_bias` on q/k/v/o; sliding-window layers follow `layer_types`, where `use_sliding_window` is set. No
experts."""

from __future__ import annotations

from dataclasses import dataclass

from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder, sliding_windows
from moelane.model.family import Family


@dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3Config(Config):
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = key(default=None, what=WINDOW)
    layer_types: list[str] | None = None

    def check(self) -> None:
        self.windows()

    def windows(self) -> list[int | None]:
        window = self.sliding_window if self.use_sliding_window else None
        return sliding_windows(self.num_hidden_layers, window, self.layer_types, by_layer_types=True)


class Qwen3(Family[Qwen3Config]):
    config_class = Qwen3Config

    def build(self, config: Qwen3Config) -> Decoder:
        c, bias, windows = config, config.attention_bias, config.windows()
        return Decoder(c, lambda i: Attention.of(c, bias=bias, qk_norm="head", o_bias=bias, window=windows[i]),
                       c.rope())  # fmt: skip


FAMILY = Qwen3()
