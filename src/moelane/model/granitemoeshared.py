"""IBM Granite MoE with a shared MLP (`granitemoeshared`): `granitemoe` (its multipliers, its router softmaxing the
top k logits over those k, its stacked experts) plus, in every layer, an always-on SwiGLU of `shared_intermediate_size`
stored fused as the experts are (`shared_mlp.input_linear`, gate rows first, and `shared_mlp.output_linear`). Its
output is added to the experts' before the residual multiplier scales their sum. `shared_intermediate_size` 0,
transformers' default, means no shared MLP."""

from __future__ import annotations

from typing import Any

from moelane.errors import ModelLoadError
from moelane.model import granitemoe
from moelane.model.decoder import Decoder

EXPERT_NAMES = granitemoe.EXPERT_NAMES
expert_prefix, find_experts, sanitize = granitemoe.expert_prefix, granitemoe.find_experts, granitemoe.sanitize
n_experts, expert_width = granitemoe.n_experts, granitemoe.expert_width


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`granitemoe.settle`, and a shared MLP of 0 (none) where the config says none."""
    width = config.get("shared_intermediate_size") or 0
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ModelLoadError(f"granitemoeshared needs shared_intermediate_size a whole number >= 0, got {width!r}")
    return granitemoe.settle({**config, "shared_intermediate_size": width})


def build(config: dict[str, Any]) -> Decoder:
    return granitemoe.build_granite(config, config["shared_intermediate_size"])
