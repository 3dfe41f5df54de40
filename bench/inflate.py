"""Widen every routed expert of the shipped model, keeping its trained routing: a memory-bound model with real routes.

The shipped qwen3_moe (hidden 192, 6 layers, 32 experts, top-4) has experts of width 96, so its decode is bound by
per-op overhead, not by reading weights. This writes a copy whose experts have width N (default 8192):
- gate_proj / up_proj keep their trained rows 0..95; rows 96..N-1 are random, normal with each matrix's own std;
- down_proj keeps its trained columns 0..95; columns 96..N-1 are normal noise of std 1e-4.
So each expert's output is the trained one plus ~1e-4 noise times the new activations, and greedy replies (and
routes) stay the shipped model's. The copy is saved as a Hugging Face release is: bf16 safetensors shards
(`model-00001-of-0000K.safetensors`) with `model.safetensors.index.json`, config.json (moe_intermediate_size N,
`dtype` the storage dtype, `moelane_compute_dtype` removed so `--dtype auto` computes in the storage dtype unless
--keep-compute-dtype), the tokenizer and generation config. Experts are made and written one shard at a time, so
peak memory stays about one shard whatever N is.

    python bench/inflate.py /tmp/inflated-8192                 # N=8192: 6 x 32 experts of 9.4 MB, 1.8 GB
    python bench/inflate.py /tmp/inflated-16k --width 16384 --shard-mb 1000

Prints one JSON line: the folder, width, total and per-expert bytes, expert bytes routed per token, seconds, config
and git revision.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/ is not a package)
from revision import git_rev

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "src" / "moelane" / "assets" / "default"
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
DOWN_NOISE = 1e-4
PROJS = ("gate_proj", "up_proj", "down_proj")


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def widened_shape(proj: str, shape: list[int], width: int) -> tuple[int, int]:
    """[I, H] gate/up -> [N, H]; [H, I] down -> [H, N]."""
    rows, cols = shape
    return (rows, width) if proj == "down_proj" else (width, cols)


def widen(w: torch.Tensor, proj: str, width: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """One trained expert matrix widened to `width`, its trained part kept exactly (a bf16 source is exact in bf16
    and in float32)."""
    rows, cols = w.shape
    if proj == "down_proj":  # [H, I]: new columns of noise
        extra = torch.randn(rows, width - cols, generator=gen) * DOWN_NOISE
        return torch.cat([w.to(dtype), extra.to(dtype)], dim=1)
    std = w.float().std().item()  # gate / up [I, H]: new rows as spread as this matrix's trained rows
    extra = torch.randn(width - rows, cols, generator=gen) * std
    return torch.cat([w.to(dtype), extra.to(dtype)], dim=0)


def plan_shards(shapes: dict[str, tuple[int, ...]], element: int, shard_bytes: int) -> list[list[str]]:
    """Tensor names in file order, packed greedily into shards of at most `shard_bytes` (one tensor at least)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = element * int(torch.Size(shape).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def file_order(names: list[str], config: dict[str, Any]) -> list[str]:
    """Embeddings, then each layer's dense tensors and its experts in order, then the final norm and LM head."""
    layers, n_experts = config["num_hidden_layers"], config["num_local_experts"]
    experts = {expert_name(i, e, p) for i in range(layers) for e in range(n_experts) for p in PROJS}
    dense = [n for n in names if n not in experts]
    order = [n for n in dense if not n.startswith("model.layers.") and "embed" in n]
    for i in range(layers):
        order += sorted(n for n in dense if n.startswith(f"model.layers.{i}."))
        order += [expert_name(i, e, p) for e in range(n_experts) for p in PROJS]
    return order + [n for n in dense if n not in order]


def tensors(source: Path, order: list[str], width: int, dtype: torch.dtype, seed: int) -> Iterator[torch.Tensor]:
    """The output tensors in `order`, made one at a time (random parts from one generator, in file order)."""
    gen = torch.Generator().manual_seed(seed)
    with safe_open(source / "model.safetensors", "pt") as f:
        for name in order:
            w = f.get_tensor(name)
            proj = name.split(".")[-2]
            if ".mlp.experts." in name and proj in PROJS:
                yield widen(w, proj, width, gen, dtype)
            else:
                yield w.to(dtype)


def inflate(
    out: Path,
    width: int = 8192,
    dtype: torch.dtype = torch.bfloat16,
    shard_mb: float = 500,
    seed: int = 0,
    keep_compute_dtype: bool = False,
    source: Path = SHIPPED,
) -> dict[str, Any]:
    """Write the widened copy of `source` to `out`; -> the summary printed as JSON."""
    start = time.perf_counter()
    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe":
        raise SystemExit(f"{source}: expected a qwen3_moe model, got {config.get('model_type')!r}")
    if width < config["moe_intermediate_size"]:
        raise SystemExit(f"--width {width} is below the trained width {config['moe_intermediate_size']}")
    with safe_open(source / "model.safetensors", "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not a dict)
    order = file_order(list(shapes), config)
    if sorted(order) != sorted(shapes):
        raise SystemExit(f"{source}: unexpected tensor names (not a plain qwen3_moe checkpoint)")
    new_shapes: dict[str, tuple[int, ...]] = {}
    for name in order:
        proj = name.split(".")[-2]
        is_expert = ".mlp.experts." in name and proj in PROJS
        new_shapes[name] = widened_shape(proj, shapes[name], width) if is_expert else tuple(shapes[name])
    element = torch.empty((), dtype=dtype).element_size()
    shards = plan_shards(new_shapes, element, int(shard_mb * 2**20))
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    made = tensors(source, order, width, dtype, seed)
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        part = {}
        for name in names:
            part[name] = next(made).contiguous()
            assert tuple(part[name].shape) == new_shapes[name], name
            weight_map[name] = file
        save_file(part, out / file, metadata={"format": "pt"})
        (out / file).chmod(0o644)  # (safetensors creates it 0600)
        del part
    total = sum(element * int(torch.Size(s).numel()) for s in new_shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config["moe_intermediate_size"] = width
    config["dtype"] = str(dtype).removeprefix("torch.")
    if not keep_compute_dtype:
        config.pop("moelane_compute_dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED:
        if (source / name).exists():
            shutil.copyfile(source / name, out / name)
    expert_bytes = 3 * width * config["hidden_size"] * element
    return {
        "out": str(out),
        "width": width,
        "dtype": config["dtype"],
        "compute_dtype": config.get("moelane_compute_dtype", config["dtype"]),
        "shards": len(shards),
        "total_bytes": total,
        "expert_bytes": expert_bytes,
        "routed_bytes_per_token": config["num_hidden_layers"] * config["num_experts_per_tok"] * expert_bytes,
        "seconds": round(time.perf_counter() - start, 2),
        "seed": seed,
        "source": str(source),
        "git": git_rev(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write the widened model to")
    p.add_argument("--width", type=int, default=8192, help="new moe_intermediate_size (default 8192)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="storage dtype")
    p.add_argument("--shard-mb", type=float, default=500, help="largest shard in MiB (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-compute-dtype", action="store_true", help="keep moelane_compute_dtype (float32) for --dtype auto"
    )
    p.add_argument("--source", type=Path, default=SHIPPED, help="the qwen3_moe folder to widen (default: shipped)")
    a = p.parse_args()
    summary = inflate(a.out, a.width, getattr(torch, a.dtype), a.shard_mb, a.seed, a.keep_compute_dtype, a.source)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
