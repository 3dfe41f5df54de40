"""What a pass reads (`moelane.model.footprint`): dense bytes are the checkpoint's weights but the embeddings and the
routed experts, counted from the checkpoint itself; an expert's bytes are its matrices' at the tier it is held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moelane
from moelane import kernels
from moelane.model.footprint import Footprint, footprint
from tests.helpers import FAMILY_CONFIGS, random_model


def checkpoint_dense_bytes(folder: Path, bytes_per_weight: int) -> int:
    """The checkpoint's weights but the routed experts', and but the embeddings' unless the LM head is tied to them."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    tied = model.config.tie_word_embeddings
    return sum(p.numel() * bytes_per_weight for name, p in model.named_parameters()
               if ".mlp.experts." not in name and (tied or "embed_tokens" not in name))  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_dense_bytes_are_the_checkpoints_weights_but_embeddings_and_experts(tmp_path: Path, tied: bool) -> None:
    folder = random_model("qwen3_moe", tmp_path, tie_word_embeddings=tied)
    shape = footprint(moelane.load(folder))
    _, _, config = FAMILY_CONFIGS["qwen3_moe"]
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    assert shape == Footprint(checkpoint_dense_bytes(folder, 4), 3 * hidden * width * 4, 2, 10, 3)


def test_an_expert_is_counted_at_its_tier(tmp_path: Path) -> None:
    folder = random_model("qwen3_moe", tmp_path)
    lm = moelane.load(folder, default_tier="int8")
    shape = footprint(lm)
    assert shape is not None
    _, _, config = FAMILY_CONFIGS["qwen3_moe"]
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    w13, w2 = (
        kernels.quantize(torch.zeros(1, 2 * width, hidden), "int8"),
        kernels.quantize(torch.zeros(1, hidden, width), "int8"),
    )
    held = sum(t.numel() * t.element_size() for p in (w13, w2) for t in (p.data, p.scales) if t is not None)
    assert shape.expert == held
    assert shape.pass_bytes(5) == shape.dense + 5 * held


def test_a_dense_model_has_no_footprint(tmp_path: Path) -> None:
    assert footprint(moelane.load(random_model("qwen3", tmp_path))) is None


def test_footprint_checks_its_numbers() -> None:
    with pytest.raises(ValueError, match="top_k"):
        Footprint(0, 1.0, 1, 2, 3)
    with pytest.raises(ValueError, match="at least one"):
        Footprint(0, 1.0, 0, 2, 1)
