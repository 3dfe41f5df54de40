"""Opening a GGUF file, or a split one (`name-00001-of-00003.gguf` and its siblings), with the `gguf` package's
reader: its metadata as plain Python values, and a `TensorRef` (file, absolute byte offset, type, stored shape) for
every tensor, so that any tensor -- and any expert's slice of a stacked one -- is read alone with a positioned read,
as a safetensors shard's are. The reader maps the file but nothing here reads tensor data.

Invariant: every TensorRef lies inside its file (checked against the file's size), so a truncated file fails here
with a message naming the tensor, never later with garbage numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from moelane.errors import ModelLoadError
from moelane.model.checkpoint import TensorRef
from moelane.model.gguf.blocks import byte_shape, is_block_type

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class GgufFile:
    """A GGUF model: its metadata (the first part's, for a split file) and every part's tensors, by llama.cpp's
    names (`blk.3.ffn_gate_exps.weight`)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorRef]

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"GGUF metadata has no general.architecture: {self.path}")
        return arch


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def open_gguf(path: Path) -> GgufFile:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    metadata: dict[str, Any] = {}
    tensors: dict[str, TensorRef] = {}
    for i, part in enumerate(split_parts(path)):
        reader = read_part(part)
        if i == 0:
            metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        tensors.update(tensor_refs(reader, part))
    return GgufFile(path, metadata, tensors)


def model_name(path: Path) -> str:
    """A GGUF model's name, the same for every part of a split file: "m" for m.gguf and m-00002-of-00003.gguf."""
    match = SPLIT.match(path.name)
    return path.stem if match is None else match["stem"]


def split_parts(path: Path) -> list[Path]:
    """The files of a split GGUF, first to last, whichever part `path` names; [path] for a file in one piece."""
    match = SPLIT.match(path.name)
    if match is None:
        return [path]
    count = match["count"]
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count}.gguf") for i in range(1, int(count) + 1)]
    for part in parts:
        if not part.is_file():
            raise ModelLoadError(f"split GGUF is missing its part {part.name} (beside {path.name})")
    return parts


class Reader(GGUFReader):
    """The `gguf` package's reader, but a tensor running past the end of a truncated file reads as zeros instead of
    failing to take its shape, so that `tensor_refs` can name it (both hooks are the pinned gguf 0.19's)."""

    _in_tensors = False

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self._in_tensors = True
        try:
            super()._build_tensors(start_offs, fields)
        finally:
            self._in_tensors = False

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        end = offset + np.dtype(dtype).itemsize * int(count)
        if self._in_tensors and end > len(self.data):
            return np.zeros(int(count), dtype=dtype)
        return super()._get(offset, dtype, count, override_order)


def read_part(path: Path) -> GGUFReader:
    try:
        return Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        size = path.stat().st_size
        raise ModelLoadError(f"corrupt or truncated GGUF file {path.name} ({size} bytes): {e}") from None


def tensor_refs(reader: GGUFReader, path: Path) -> dict[str, TensorRef]:
    """Where each tensor of one part lies. Shapes in numpy order (a GGUF lists its dimensions innermost first);
    block-quantised tensors as their bytes (`blocks.byte_shape`)."""
    size = path.stat().st_size
    refs = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if is_block_type(kind):  # (other types keep their shape; those moelane cannot read are refused where used)
            shape = byte_shape(shape, kind)
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ModelLoadError(f"truncated GGUF file {path.name}: tensor {t.name} ends at byte {end}, past the end "
                                 f"of the file ({size} bytes)")  # fmt: skip
        refs[t.name] = TensorRef(str(path), int(t.data_offset), int(t.n_bytes), kind, shape)
    return refs
