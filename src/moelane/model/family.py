"""What a model family is to `load`, and where one is found.

A family is a module of `moelane.model.families` named by its `model_type` (mlx-lm's registry: an import, no table of
classes to keep), whose `FAMILY` implements `Family`. Its members with a body are the defaults: a family subclasses
`Family` and writes only what differs (its config, its `build`, and where its checkpoints differ from the common
layout: expert names, a rename, tensors to skip or keep in fp32). No family imports another: what two share lives in
a shared module (`layers`, `rope`, `attention`, `latent`, `routers`, `moe`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar

from moelane.errors import ModelLoadError
from moelane.model.checkpoint import LAYER, ExpertHandle, TensorRef, find_expert_handles
from moelane.model.config import Config
from moelane.model.decoder import Decoder

FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "lfm2_moe",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "phimoe",
    "granitemoe",
    "granitemoeshared",
    "glm4_moe_lite",
    "dots1",
    "minimax_m2",
    "exaone_moe",
    "llama4",
    "llama4_text",
    "qwen3",
    "llama",
)
# model types another family's module reads whole (as mlx-lm's MODEL_REMAPPING): Llama 4's text model as transformers
# saves it; Granite MoE with a shared MLP, which `granitemoe` builds wherever `shared_intermediate_size` says
REMAPPED = {"llama4_text": "llama4", "granitemoeshared": "granitemoe"}
GATE_UP_DOWN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # most checkpoints' expert names
W1_W3_W2 = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's and its kin's
# A sigmoid router's tensors, kept in fp32 whatever the model's dtype, as transformers keeps them: the score bias
# decides near-ties between experts, and bf16 would move them.
ROUTER_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
T = TypeVar("T")
C = TypeVar("C", bound=Config)


class Family(Protocol[C]):
    """How to read and build one family's checkpoints. `C`: its config class."""

    config_class: type[C]  # the family's typed config
    expert_names: ClassVar[Mapping[str, str]] = GATE_UP_DOWN  # ours ("gate", "up", "down") -> the checkpoint's
    keep_fp32: ClassVar[tuple[str, ...]] = ()  # parameter name endings kept in fp32 whatever the dtype (routers)
    quantized: ClassVar[tuple[str, ...]] = ()  # `quant_method`s whose experts it reads itself (gpt-oss: mxfp4)

    def build(self, config: C) -> Decoder:
        """The decoder, with zeros for weights (`load` fills them); `config.moe_layers()` are its MoE layers."""
        ...

    def expert_prefix(self, layer: int) -> str:
        """Where a MoE layer's experts are in the checkpoint (before `sanitize`)."""
        return f"model.layers.{layer}.mlp.experts"

    def find_experts(
        self, refs: dict[str, TensorRef], prefix: str, n_experts: int, fp8_block: tuple[int, int] | None
    ) -> list[ExpertHandle] | None:
        """The handles of a layer's experts under `prefix` (None: none there)."""
        return find_expert_handles(refs, prefix, n_experts, dict(self.expert_names), fp8_block)

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        """The checkpoint's dense tensor names -> the decoder's parameter names (values untouched)."""
        return weights

    def ignored(self, config: C, name: str) -> bool:
        """Whether a checkpoint tensor is one the family skips without a word (multi-token prediction, vision)."""
        return False


def family_of(model_type: str) -> Family[Any]:
    """The family of a `model_type`, or a ModelLoadError listing those there are."""
    if model_type not in FAMILIES:
        raise ModelLoadError(f"unsupported model_type {model_type!r}; supported: {', '.join(FAMILIES)}")
    module = importlib.import_module(f"moelane.model.families.{REMAPPED.get(model_type, model_type)}")
    family: Family[Any] = module.FAMILY
    return family


def past_last_layer(n_layers: int, name: str) -> bool:
    """Whether a checkpoint tensor belongs to a layer past the decoder's `n_layers`: the multi-token-prediction layers
    GLM-4.5, DeepSeek-V3 and MiniMax-M2 ship, which plain decoding does not use (a family's `ignored`)."""
    match = LAYER.match(name)
    return match is not None and int(match.group(1)) >= n_layers
