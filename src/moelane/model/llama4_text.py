"""Llama 4's text model as transformers' Llama4ForCausalLM saves it (`model_type` "llama4_text": its config at the
top level, its tensors without the release's `language_model.`): the `llama4` family, which reads both."""

from moelane.model.llama4 import (
    EXPERT_NAMES,
    build,
    expert_prefix,
    expert_width,
    find_experts,
    ignored,
    n_experts,
    sanitize,
    settle,
)

__all__ = ["EXPERT_NAMES", "build", "expert_prefix", "expert_width", "find_experts", "ignored", "n_experts",
           "sanitize", "settle"]  # fmt: skip
