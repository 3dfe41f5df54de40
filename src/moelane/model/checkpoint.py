"""Reads a Hugging Face model folder as users have it, without loading the experts.

What it reads: `config.json`, the safetensors shards (one file, or several with `model.safetensors.index.json`),
`generation_config.json` (EOS ids). Every tensor becomes a `TensorRef` (file, byte offset, dtype, shape) taken from the
shard's own header, so any one tensor -- and so any one expert -- can later be read alone with `os.pread`: that is how
the pager fetches experts from disk. Dense tensors are read at load; experts only when a provider asks.

Invariant: every TensorRef points inside its file (checked against the file size when the header is read), so a
truncated or corrupt shard fails here with a message naming the file, not later with garbage numbers.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from moelane.errors import ModelLoadError
from moelane.model.gguf.blocks import BLOCK_TYPES, dequantize, is_block_type, logical_shape

T = TypeVar("T")
LAYER = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's tensors (after a release's own prefix)

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    **dict.fromkeys(BLOCK_TYPES, torch.uint8),  # a GGUF's block-quantised tensors, held as their bytes (gguf/blocks.py)
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where one tensor (or one expert's slice of a stacked tensor) lies on disk."""

    path: str
    offset: int  # absolute byte offset in the file
    nbytes: int
    dtype: str  # safetensors dtype name, e.g. "BF16"; or a GGUF's block type, e.g. "Q8_0"
    shape: tuple[int, ...]  # as stored: for a block type, [..., bytes per row]

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The shape of the values it holds: `shape`, but for a block type the number of values in a row last."""
        return logical_shape(self.shape, self.dtype)


@dataclass(frozen=True, slots=True)
class ExpertHandle:
    """One routed expert's tensors, in one of these layouts:

    - "linear": `F.linear` weights, "gate", "up" and "down" (or "gate_up" and "down" for fused checkpoints);
    - "transposed": gpt-oss's fused "gate_up" [H, 2I] (gate and up columns interleaved) and "down" [I, H];
    - "mxfp4": the same as 4-bit floats in blocks of 32 with a shared power-of-two scale (gpt-oss's release),
      "gate_up_blocks" [2I, H/32, 16] and "gate_up_scales" [2I, H/32], "down_blocks" and "down_scales" (uint8);
    - "fp8": "gate", "up" and "down" as "linear", in float8 (e4m3), each with the fp32 scale of every `block` of
      its weights ("gate_scale", ...: a checkpoint's `weight_scale_inv`), as DeepSeek, Qwen and GLM release them;
    - "gguf": "gate", "up" and "down" (or "gate_up" and "down") as "linear", some or all of them blocks of a GGML type
      (Q8_0, Q4_K, ...: `TensorRef.dtype`), decoded with the `gguf` package as an expert is loaded;
    - "gguf_pairs": the same, with the gate and up rows interleaved in the pool (gpt-oss's activation reads them so).
    """

    layer: int
    expert: int
    tensors: dict[str, TensorRef]
    layout: str = "linear"
    block: tuple[int, int] = (0, 0)  # "fp8": the rows and columns one scale covers

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def dims(self) -> tuple[int, int]:
        """(hidden, expert width)."""
        if self.layout == "mxfp4":
            hidden, groups, half = self.tensors["down_blocks"].shape
            return hidden, groups * half * 2
        rows, cols = self.tensors["down"].value_shape
        return (cols, rows) if self.layout == "transposed" else (rows, cols)

    @property
    def path(self) -> str:
        """The shard file holding the expert (its first tensor's)."""
        return next(iter(self.tensors.values())).path


def expected_shapes(
    layout: str, hidden: int, width: int, block: tuple[int, int] = (0, 0)
) -> dict[str, tuple[int, ...]]:
    """The shape each of an expert's tensors must have in `layout`, for a model of `hidden` and expert `width`."""
    if layout == "transposed":
        return {"gate_up": (hidden, 2 * width), "down": (width, hidden)}
    if layout == "mxfp4":
        return {"gate_up_blocks": (2 * width, hidden // 32, 16), "gate_up_scales": (2 * width, hidden // 32),
                "down_blocks": (hidden, width // 32, 16), "down_scales": (hidden, width // 32)}  # fmt: skip
    weights: dict[str, tuple[int, ...]] = {  # (of the values: `TensorRef.value_shape`)
        "gate": (width, hidden),
        "up": (width, hidden),
        "gate_up": (2 * width, hidden),
        "down": (hidden, width),
    }
    if layout == "fp8":
        rows, cols = block
        scales = {f"{name}_scale": (-(-r // rows), -(-c // cols)) for name, (r, c) in weights.items()}
        return {**weights, **scales}
    return weights


def read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{what} is not valid JSON: {path} ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} must hold a JSON object: {path}")
    return data


def read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise ModelLoadError(f"model folder is a file, not a folder: {folder}" if folder.exists()
                             else f"model folder not found: {folder}")  # fmt: skip
    config = read_json(folder / "config.json", "config.json")
    if "model_type" not in config:
        raise ModelLoadError(f"config.json has no model_type: {folder / 'config.json'}")
    return config


def read_eos_ids(folder: Path, config: Mapping[str, Any]) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json; an int or a list in either."""
    ids: set[int] = set()
    sources: list[Mapping[str, Any]] = [config]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.insert(0, read_json(gen, "generation_config.json"))
    for source in sources:
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            if not all(isinstance(v, int) for v in value):
                raise ModelLoadError(f"eos_token_id must be a token id or a list of them, got {value!r}")
            ids.update(value)
        if ids:
            break
    return frozenset(ids)


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"model.safetensors.index.json has no weight_map: {index}")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"missing shard {f.name} named in {index.name}: {f}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(f for f in folder.glob("*.safetensors") if f.is_file())
    if not found:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return found


def read_header(path: Path) -> dict[str, TensorRef]:
    """Parse one safetensors header into TensorRefs, checking every tensor lies inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"corrupt safetensors file (no header): {path}")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise ModelLoadError(f"corrupt safetensors header (length {n}, file {size} bytes): {path}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelLoadError(f"corrupt safetensors header (not JSON): {path}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"corrupt safetensors header (not an object): {path}")
    refs: dict[str, TensorRef] = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"corrupt safetensors header entry {name!r}: {path}") from None
        if dtype not in DTYPES:
            raise ModelLoadError(f"unsupported dtype {dtype} for tensor {name!r} in {path}")
        if base + end > size:
            raise ModelLoadError(f"truncated shard {path.name}: tensor {name!r} ends past the end of the file")
        refs[name] = TensorRef(str(path), base + begin, end - begin, dtype, shape)
    return refs


def scan_checkpoint(folder: Path) -> dict[str, TensorRef]:
    refs: dict[str, TensorRef] = {}
    for path in shard_files(folder):
        refs.update(read_header(path))
    return refs


def read_tensor(ref: TensorRef, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Read one tensor with a positioned read (no mmap of the file): as stored, or its values in `dtype` if given
    (a GGUF's blocks decoded)."""
    buf = torch.empty(ref.nbytes, dtype=torch.uint8)
    read_bytes(ref, buf)
    t = buf.view(DTYPES[ref.dtype]).reshape(ref.shape)
    if dtype is not None and is_block_type(ref.dtype):
        return dequantize(t, ref.dtype).to(dtype)
    return t if dtype is None else t.to(dtype)


def read_tensor_into(ref: TensorRef, out: torch.Tensor) -> None:
    """`out.copy_(tensor)`, reading straight into `out` when it already has the checkpoint's dtype and layout (no
    buffer in between, so loading a model allocates nothing but its parameters)."""
    if fits_in_place(ref, out):
        read_bytes(ref, out)
    else:
        out.copy_(read_tensor(ref, out.dtype))


def fits_in_place(ref: TensorRef, out: torch.Tensor) -> bool:
    """Whether the tensor's bytes, as stored, are exactly `out`'s (same dtype and shape, `out` contiguous)."""
    same = out.dtype == DTYPES[ref.dtype] and tuple(out.shape) == tuple(ref.shape)
    return same and out.dim() > 0 and out.is_contiguous()


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor of at least one dimension, writable in place."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy().data)


def read_bytes(ref: TensorRef, out: torch.Tensor) -> None:
    """The tensor's raw bytes into `out` (contiguous, `ref.nbytes` long)."""
    fd = os.open(ref.path, os.O_RDONLY)
    try:
        n = os.preadv(fd, [byte_view(out)], ref.offset)
    finally:
        os.close(fd)
    if n != ref.nbytes:
        raise ModelLoadError(f"short read of {ref.nbytes} bytes at offset {ref.offset} in {ref.path} (truncated?)")


def expert_tensors(
    w: dict[str, torch.Tensor], handle: ExpertHandle, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool layout in `dtype` from one expert's tensors as stored (`handle.layout`): (w13 [2I, H], w2 [H, I]). The
    rows of w13 are the gate_up projection's outputs in the checkpoint's order (gate then up, or interleaved for
    gpt-oss: the family's activation knows which)."""
    layout = handle.layout
    if layout in ("gguf", "gguf_pairs"):
        return gguf_expert(w, handle, dtype)
    if layout == "fp8":
        w = {
            name: fp8_to(w[name], w[f"{name}_scale"], handle.block, dtype) for name in w if not name.endswith("_scale")
        }
        layout = "linear"
    if layout == "mxfp4":
        w13 = mxfp4_to(w["gate_up_blocks"], w["gate_up_scales"], dtype)
        return w13, mxfp4_to(w["down_blocks"], w["down_scales"], dtype)
    w = {name: t.to(dtype) for name, t in w.items()}
    if layout == "transposed":
        return w["gate_up"].t().contiguous(), w["down"].t().contiguous()
    w13 = w["gate_up"] if "gate_up" in w else torch.cat([w["gate"], w["up"]], dim=0)
    return w13, w["down"]


def gguf_expert(
    w: dict[str, torch.Tensor], handle: ExpertHandle, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_tensors` of the "gguf" layouts: block-quantised tensors decoded, gate and up rows stacked (or
    interleaved, "gguf_pairs")."""
    values = {}
    for name, t in w.items():
        kind = handle.tensors[name].dtype
        values[name] = (dequantize(t, kind) if is_block_type(kind) else t).to(dtype)
    if handle.layout == "gguf" and "gate_up" in values:
        return values["gate_up"], values["down"]
    gate, up = values["gate_up"].chunk(2) if "gate_up" in values else (values["gate"], values["up"])
    if handle.layout == "gguf_pairs":
        return torch.stack([gate, up], dim=1).reshape(-1, gate.shape[1]), values["down"]
    return torch.cat([gate, up], dim=0), values["down"]


# The sixteen values of a 4-bit float (e2m1), by code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_to(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (OCP microscaling) -> [rows, G * 32] in `dtype`: blocks [rows, G, 16] hold two 4-bit codes a byte, the
    low nibble first; each block of 32 values shares the scale 2^(scales - 127). Every value is exact in bf16."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [rows, G, 16, 2]
    values = lut[codes].reshape(*scales.shape, 32)
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).reshape(scales.shape[0], -1).to(dtype)


def fp8_to(weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """A float8 weight [R, C] with one scale per `block` (scales [ceil(R / rows), ceil(C / cols)], a checkpoint's
    `weight_scale_inv`) -> `weight * scale` in `dtype`, computed in fp32 as transformers and DeepSeek compute it."""
    rows, cols = block
    r, c = weight.shape
    grid = scales.float().repeat_interleave(rows, dim=0)[:r].repeat_interleave(cols, dim=1)[:, :c]
    return (weight.float() * grid).to(dtype)


def read_expert(handle: ExpertHandle, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's weights in pool layout, read from its shard."""
    try:
        w = {name: read_tensor(ref) for name, ref in handle.tensors.items()}
    except ModelLoadError as e:
        raise ModelLoadError(f"expert {handle.expert} of layer {handle.layer}: {e}") from None
    return expert_tensors(w, handle, dtype)


def slice_stacked(ref: TensorRef, index: int) -> TensorRef:
    """The TensorRef of row `index` of a stacked [E, ...] tensor (fused expert checkpoints)."""
    per = ref.nbytes // ref.shape[0]
    return TensorRef(ref.path, ref.offset + index * per, per, ref.dtype, ref.shape[1:])


def renamed(weights: dict[str, T], renames: list[tuple[re.Pattern[str], str]]) -> dict[str, T]:
    """`weights` under new names, each name through every (pattern, replacement) of `renames` in turn (values
    untouched: tensors or their disk references); a family's `sanitize`."""
    out = {}
    for name, w in weights.items():
        for pattern, new in renames:
            name = pattern.sub(new, name)
        out[name] = w
    return out


def layer_of(prefix: str) -> int:
    """The layer number in an expert prefix (`model.layers.3.mlp.experts`; Llama 4's release puts
    `language_model.` before it)."""
    match = LAYER.search(prefix + ".")
    if match is None:
        raise ModelLoadError(f"no layer number in expert prefix {prefix!r}")
    return int(match.group(1))


def stacked_experts(
    refs: dict[str, TensorRef], prefix: str, names: dict[str, str], n_experts: int, layout: str = "linear"
) -> list[ExpertHandle] | None:
    """Handles for a layer whose experts are stacked, one [E, ...] tensor per name (`names`: ours -> the checkpoint's,
    under `prefix`), each expert a slice of them in `layout`. None when the first name is not in the checkpoint."""
    if f"{prefix}.{next(iter(names.values()))}" not in refs:
        return None
    stacked = {}
    for ours, theirs in names.items():
        ref = refs.get(f"{prefix}.{theirs}")
        if ref is None:
            raise ModelLoadError(f"checkpoint is missing tensor {prefix}.{theirs}")
        if not ref.shape or ref.shape[0] != n_experts:
            raise ModelLoadError(f"{prefix}.{theirs} has shape {list(ref.shape)}, config.json implies {n_experts} "
                                 "experts")  # fmt: skip
        stacked[ours] = ref
    layer = layer_of(prefix)
    return [ExpertHandle(layer, e, {name: slice_stacked(ref, e) for name, ref in stacked.items()}, layout)
            for e in range(n_experts)]  # fmt: skip


def find_expert_handles(
    refs: dict[str, TensorRef],
    prefix: str,
    n_experts: int,
    names: dict[str, str],
    fp8_block: tuple[int, int] | None = None,
) -> list[ExpertHandle] | None:
    """Handles for the experts under `prefix` (e.g. "model.layers.3.mlp.experts").

    `names` maps our names ("gate", "up", "down") to the checkpoint's (e.g. "gate_proj"). Per-expert tensors
    (`{prefix}.{e}.{name}.weight`) and fused stacked ones (`{prefix}.gate_up_proj`, `{prefix}.down_proj`) both work;
    per-expert float8 ones with their `weight_scale_inv` too, in a checkpoint of `fp8_block` scales.
    Returns None when the prefix holds no experts.
    """
    fused = stacked_experts(refs, prefix, {"gate_up": "gate_up_proj", "down": "down_proj"}, n_experts)
    if fused is not None:
        return fused
    if f"{prefix}.0.{names['gate']}.weight" not in refs:
        return None
    fp8 = fp8_block is not None and f"{prefix}.0.{names['gate']}.weight_scale_inv" in refs
    layout, block = ("fp8", fp8_block) if fp8 and fp8_block else ("linear", (0, 0))
    layer = layer_of(prefix)
    handles = []
    for e in range(n_experts):
        tensors = {}
        for ours, theirs in names.items():
            keys = {ours: f"{prefix}.{e}.{theirs}.weight"}
            if fp8:
                keys[f"{ours}_scale"] = f"{prefix}.{e}.{theirs}.weight_scale_inv"
            for name, key in keys.items():
                if key not in refs:
                    raise ModelLoadError(f"checkpoint is missing tensor {key}")
                tensors[name] = refs[key]
        handles.append(ExpertHandle(layer, e, tensors, layout, block))
    return handles


FUSED_NAMES = {"gate_up": "gate_up_proj", "down": "down_proj"}
MXFP4_NAMES = {"gate_up_blocks": "gate_up_proj_blocks", "gate_up_scales": "gate_up_proj_scales",
               "down_blocks": "down_proj_blocks", "down_scales": "down_proj_scales"}  # fmt: skip


def fused_experts(refs: dict[str, TensorRef], prefix: str, n_experts: int) -> list[ExpertHandle] | None:
    """A layer's experts stored fused as transformers saves gpt-oss's and Llama 4's (`gate_up_proj` [E, H, 2I],
    `down_proj` [E, I, H]: layout "transposed"), or as gpt-oss is released, in MXFP4 (layout "mxfp4")."""
    mxfp4 = stacked_experts(refs, prefix, MXFP4_NAMES, n_experts, "mxfp4")
    return mxfp4 or stacked_experts(refs, prefix, FUSED_NAMES, n_experts, "transposed")
