"""Checkpoints in float8 with block scales (DeepSeek-V3/R1, Qwen3-*-FP8, GLM-4.5-Air-FP8, MiniMax-M2): every
projection's weight in e4m3 with an fp32 scale per block (`weight_scale_inv`), dense and expert weights alike.

The reference is transformers' own loader, which expands such a checkpoint on a machine without a GPU: our logits
must be its logits (fp32, 1e-4), resident or paged.
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
from moelane.errors import ModelLoadError
from moelane.model.checkpoint import fp8_to
from tests.helpers import check_pages_as_resident, drop_tensor, random_model

E4M3_MAX = 448.0


def to_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 weights, fp32 scale per block [ceil(R / rows), ceil(C / cols)]), as the releases quantize."""
    rows, cols = block
    r, c = w.shape
    grid_r, grid_c = -(-r // rows), -(-c // cols)
    padded = torch.nn.functional.pad(w, (0, grid_c * cols - c, 0, grid_r * rows - r)).view(grid_r, rows, grid_c, cols)
    scale = padded.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    q = (padded / scale[:, None, :, None]).view(grid_r * rows, grid_c * cols)[:r, :c]
    return q.to(torch.float8_e4m3fn), scale.float()


def fp8_checkpoint(folder: Path, out: Path, block: tuple[int, int], fmt: str = "e4m3") -> Path:
    """A copy of `folder` with every projection weight (not norms, embeddings, LM head or router) in float8; `fmt`
    as the config spells it."""
    shutil.copytree(folder, out)
    weights, packed = load_file(folder / "model.safetensors"), {}
    for name, w in weights.items():
        if w.dim() == 2 and name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            packed[name], packed[name + "_scale_inv"] = to_fp8(w, block)
        else:
            packed[name] = w
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_fp8_expands_block_by_block() -> None:
    """Blocks that do not divide the weight (transformers refuses those; DeepSeek's own kernel takes them)."""
    w = torch.randn(20, 30)
    q, scale = to_fp8(w, (8, 16))
    assert scale.shape == (3, 2)
    want = torch.empty(20, 30)
    for i in range(20):
        for j in range(30):
            want[i, j] = q[i, j].float() * scale[i // 8, j // 16]
    assert torch.equal(fp8_to(q, scale, (8, 16), torch.float32), want)
    assert (fp8_to(q, scale, (8, 16), torch.float32) - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits


CASES = [
    ("qwen3_moe", {}, "e4m3"),
    ("glm4_moe", {}, "e4m3"),  # its router stays fp32, unquantized
    # MLA with every width a multiple of 8 (transformers' expansion needs whole blocks), q through its LoRA
    ("deepseek_v3", dict(kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, q_lora_rank=24), "e4m3"),
    ("minimax_m2", {}, "float8_e4m3fn"),  # experts named w1/w3/w2, the format spelt as MiniMax-M2's release does
]


@pytest.mark.parametrize(("family", "overrides", "fmt"), CASES, ids=[c[0] for c in CASES])
def test_an_fp8_checkpoint_runs_as_transformers_expands_it(
    family: str, overrides: dict, fmt: str, tmp_path: Path
) -> None:
    import transformers

    folder = fp8_checkpoint(random_model(family, tmp_path / "base", **overrides), tmp_path / "fp8", (8, 8), fmt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                            attn_implementation="eager").eval()  # fmt: skip
    lm = moelane.load(folder)
    assert next(iter(lm.expert_handles.values()))[0].layout == "fp8"
    prompt = list(range(5, 45))
    with torch.no_grad():
        assert (lm.logits(prompt) - ref(torch.tensor([prompt])).logits[0]).abs().max().item() <= 1e-4
    check_pages_as_resident(folder, prompt)


def test_an_fp8_checkpoint_missing_a_scale_is_refused(tmp_path: Path) -> None:
    folder = fp8_checkpoint(random_model("qwen3_moe", tmp_path / "base"), tmp_path / "fp8", (8, 8))
    drop_tensor(folder, "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv")
    with pytest.raises(ModelLoadError, match=re.escape("missing tensor model.layers.0.mlp.experts.3.up_proj.weight_")):
        moelane.load(folder)


def test_float8_weights_without_their_scales_are_refused(tmp_path: Path) -> None:
    """Read without its scales, a float8 weight would load as numbers about 1/scale too large, silently."""
    folder = fp8_checkpoint(random_model("qwen3_moe", tmp_path / "base"), tmp_path / "fp8", (8, 8))
    drop_tensor(folder, "model.layers.2.self_attn.o_proj.weight_scale_inv")
    with pytest.raises(ModelLoadError, match=re.escape("float8 tensor model.layers.2.self_attn.o_proj.weight has no")):
        moelane.load(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"float8 .* without block scales"):
        moelane.load(folder)
