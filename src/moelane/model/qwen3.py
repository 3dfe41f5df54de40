"""Qwen3 dense (Qwen3-0.6B ... 32B; the shipped draft model): Llama-shaped with per-head q/k RMSNorm and
`attention_bias` on q/k/v/o; sliding-window layers follow `layer_types`. No experts."""

from __future__ import annotations

from typing import Any

from moelane.model.decoder import Decoder
from moelane.model.llama import EXPERT_NAMES, build_dense, expert_prefix, expert_width, n_experts

__all__ = ["EXPERT_NAMES", "build", "expert_prefix", "expert_width", "n_experts"]


def build(config: dict[str, Any]) -> Decoder:
    return build_dense(config, qk_norm="head", sliding=True)
