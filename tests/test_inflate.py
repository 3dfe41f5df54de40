"""bench/inflate.py: the widened model keeps the shipped model's greedy replies (its trained parts kept exactly)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moelane
from moelane.model.family import family_of
from moelane.model.load import checkpoint_dtype
from moelane.model.sampling import SamplingParams

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "inflate.py"
PROMPTS = [
    "def fibonacci(n):",
    "class Matrix:\n    def __init__(self, rows):",
    "HAMLET. To be, or not to be,",
]
WIDTH = 256


def load_script():  # bench/ is not a package
    spec = importlib.util.spec_from_file_location("bench_inflate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inflated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("inflated")
    summary = load_script().inflate(out, width=WIDTH, shard_mb=20, keep_compute_dtype=True)
    return out, summary


def test_layout(inflated: tuple[Path, dict]) -> None:
    out, summary = inflated
    config = json.loads((out / "config.json").read_text())
    assert config["moe_intermediate_size"] == WIDTH and config["dtype"] == "bfloat16"
    typed = family_of("qwen3_moe").config_class.from_dict(config)
    assert config["moelane_compute_dtype"] == "float32" and checkpoint_dtype(typed) == torch.float32
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == summary["shards"] > 1
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert summary["expert_bytes"] == 3 * WIDTH * 192 * 2
    with safe_open(load_script().SHIPPED / "model.safetensors", "pt") as old:
        name = "model.layers.3.mlp.experts.7."
        with safe_open(out / index["weight_map"][name + "gate_proj.weight"], "pt") as new:
            gate, down = new.get_tensor(name + "gate_proj.weight"), new.get_tensor(name + "down_proj.weight")
        assert gate.shape == (WIDTH, 192) and down.shape == (192, WIDTH)
        assert torch.equal(gate[:96], old.get_tensor(name + "gate_proj.weight"))
        assert torch.equal(down[:, :96], old.get_tensor(name + "down_proj.weight"))
        assert down[:, 96:].float().std() < 2e-4
    assert sum(1 for _ in index["weight_map"]) == 633


def test_same_greedy_replies(inflated: tuple[Path, dict]) -> None:
    out, _ = inflated
    shipped, wide = moelane.load(), moelane.load(out)
    assert wide.dtype == shipped.dtype == torch.float32
    for prompt in PROMPTS:
        ids = shipped.tokenizer.encode(prompt)
        want = list(shipped.generate_ids(ids, 32, SamplingParams()))
        got = list(wide.generate_ids(ids, 32, SamplingParams()))
        assert len(want) > 8, prompt
        assert got == want, prompt
