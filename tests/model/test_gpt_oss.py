"""gpt-oss as released: experts in MXFP4 (4-bit floats in blocks of 32 with a power-of-two scale).

transformers' own expansion (`convert_moe_packed_tensors`) is the reference: our expansion must give the same
numbers, and a checkpoint in MXFP4 must run exactly as the checkpoint holding transformers' expansion of it (which
the family tests hold to transformers' logits), all experts resident or paged.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moelane
from moelane.model.checkpoint import FP4_VALUES, mxfp4_to
from tests.helpers import check_pages_as_resident, drop_tensor, random_model


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] (C a multiple of 32) -> the nearest MXFP4: blocks [..., R, C/32, 16] and scales [..., R, C/32]."""
    lut = torch.tensor(FP4_VALUES)
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6)).clamp(-127, 127)
    codes = ((groups / torch.exp2(exp)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def test_mxfp4_expands_as_transformers_does() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code, both nibbles
    scales = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        ours = torch.stack([mxfp4_to(b, s, dtype) for b, s in zip(blocks, scales, strict=True)])  # [E, out, in]
        assert torch.equal(ours.transpose(1, 2), want), dtype


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, the same with its experts expanded by transformers), from one random model."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    base = random_model("gpt_oss", tmp_path_factory.mktemp("base"), hidden_size=64, intermediate_size=32)
    packed, expanded = tmp_path_factory.mktemp("mxfp4"), tmp_path_factory.mktemp("expanded")
    for folder in (packed, expanded):
        shutil.copytree(base, folder, dirs_exist_ok=True)
    weights = load_file(base / "model.safetensors")
    quantized, dense = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(weights.pop(name).transpose(1, 2))  # stored [E, out, in/32, 16]
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(quantized, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, expanded / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    return packed, expanded


def test_an_mxfp4_checkpoint_runs_as_its_expansion(checkpoints: tuple[Path, Path]) -> None:
    import transformers

    packed, expanded = checkpoints
    prompt = list(range(5, 45))
    lm = moelane.load(packed)
    assert lm.expert_handles[0][0].layout == "mxfp4"
    assert torch.equal(lm.logits(prompt), moelane.load(expanded).logits(prompt))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(expanded), attn_implementation="eager").eval()
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= 1e-4
    bf16 = moelane.load(packed, dtype=torch.bfloat16)
    assert list(bf16.generate_ids(prompt, 12)) == list(
        moelane.load(expanded, dtype=torch.bfloat16).generate_ids(prompt, 12)
    )


def test_an_mxfp4_checkpoint_pages_with_identical_tokens(checkpoints: tuple[Path, Path]) -> None:
    """The pager keeps the 4-bit form as the experts' stored tier and expands an expert into its slot on a miss."""
    check_pages_as_resident(checkpoints[0], list(range(3, 30)))


def test_a_checkpoint_missing_an_expert_tensor_is_refused(checkpoints: tuple[Path, Path], tmp_path: Path) -> None:
    from moelane.errors import ModelLoadError

    packed, _ = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    drop_tensor(broken, "model.layers.1.mlp.experts.down_proj_scales")
    with pytest.raises(ModelLoadError, match=re.escape("missing tensor model.layers.1.mlp.experts.down_proj_scales")):
        moelane.load(broken)
