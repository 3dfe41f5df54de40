"""Where a missing expert comes from: the model's own shards, a tier file of quantised experts, or host RAM.

- `ShardFiles` keeps one read-only descriptor per shard and reads an expert's tensors with positioned reads
  that leave nothing in the page cache (uncached.py: O_DIRECT through a bounce buffer, else DONTNEED after each read)
  into the pool slot when the bytes already have its dtype and layout, else into a buffer; no mmap of the model,
  nothing loaded at start-up. Each read first checks
  the file's size and mtime against those seen when it was opened, and a short read is an error: a shard truncated or
  rewritten while we run raises `ExpertReadError` naming the file and the expert, never yields wrong numbers.
- `TierFile`: every expert of the model encoded at one quantised tier (tiers.py), at fixed offsets in one file beside
  the model (or under ~/.cache/moelane when the model folder is read-only), with a CRC-32 per expert checked on every
  read and a fingerprint of the shards it was built from (a changed checkpoint rebuilds it). Built once, on first use.
  A GGUF's tier files carry its name (`.moelane/m.experts-int4.bin` for m.gguf), so GGUFs that share a folder keep
  their own.
- `HostCache`: stored forms (any tier) kept in host RAM under their own byte budget, least recently used dropped first.
  Its copies are the transfer's host buffers (transfer.py: pinned memory when the pools are on a CUDA device), each
  counted at the bytes it really takes.
- A GGUF's Q8_0 / Q4_0 experts at their own codes' tier (`tiers.tier_format`) need no tier file: their stored form
  there is the file's blocks, as at tier 0, repacked into the slot's codes and scales (`model.gguf.codes`).

An expert's *stored form* is a flat uint8 buffer: at tier 0 its checkpoint tensors' raw bytes back to back in handle
order, at tier > 0 its `ExpertCodec` blob. Tier 0 is decoded straight into a pool slot (converted to the compute
dtype); a blob is the bytes of its slot's four parts back to back, so it is read straight into them, or copied from
host RAM: never dequantised.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moelane.errors import ModelLoadError, MoelaneError
from moelane.kernels.formats import QUANTIZER_VERSION
from moelane.kernels.pool import interleave_into
from moelane.model.checkpoint import DTYPES, ExpertHandle, TensorRef, byte_view, expert_tensors, fits_in_place
from moelane.model.derived import cache_dir, file_fingerprint
from moelane.model.gguf.codes import codes_tier, expert_codes_into
from moelane.model.gguf.file import is_gguf, model_name
from moelane.pager.live.tiers import TIER_NAMES, ExpertCodec, fill_part, row_blocks, rows_major_part
from moelane.pager.live.transfer import Transfer
from moelane.pager.live.uncached import Bounce, UncachedFile

log = logging.getLogger(__name__)
# bump whenever the blob layout changes (2: adaptive group size; 3: int4 scales); the quantiser's own version
# (formats.QUANTIZER_VERSION) is recorded beside it, and a file of another is built again. Files of version 3 were all
# made by quantiser 3 (they did not record it).
TIER_FILE_VERSION = 3


class ExpertReadError(MoelaneError):
    """An expert could not be read intact (shard truncated, rewritten or corrupt; tier file damaged)."""


def expert_name(handle: ExpertHandle) -> str:
    return f"expert {handle.expert} of layer {handle.layer}"


class ShardFiles:
    """Read-only descriptors of the shards, opened lazily, validated on every read."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[UncachedFile, int, int]] = {}  # path -> (file, size, mtime_ns) at open
        self._lock = threading.Lock()
        self.bounce = Bounce()

    def _file(self, path: str) -> tuple[UncachedFile, int, int]:
        with self._lock:
            if path not in self._open:
                f = UncachedFile(path, self.bounce)
                st = os.fstat(f.fd)
                self._open[path] = (f, st.st_size, st.st_mtime_ns)
            return self._open[path]

    def read_into(self, ref: TensorRef, out: memoryview, what: str) -> None:
        """Read one tensor's bytes into `out` (exactly `ref.nbytes` long), leaving nothing in the page cache."""
        try:
            f, size, mtime = self._file(ref.path)
            st = os.fstat(f.fd)
            if st.st_size != size or st.st_mtime_ns != mtime:
                raise ExpertReadError(
                    f"{what}: shard {ref.path} changed on disk while the model was running "
                    f"(size {size} -> {st.st_size} bytes, modified after it was opened)"
                )
            n = f.pread([out], ref.offset)
        except OSError as e:
            raise ExpertReadError(f"{what}: cannot read {ref.path}: {e}") from None
        if n != ref.nbytes:
            raise ExpertReadError(
                f"{what}: short read ({n} of {ref.nbytes} bytes at offset {ref.offset}) from {ref.path}: "
                "shard truncated?"
            )

    def drop_page_cache(self, paths: list[str]) -> None:
        """Ask the OS to drop these files' cached pages (benchmarks: reads then really come from the disk)."""
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for f, _, _ in self._open.values():
                f.close()
            self._open.clear()


def read_native(files: ShardFiles, handle: ExpertHandle, buf: torch.Tensor | None = None) -> torch.Tensor:
    """An expert's tier-0 stored form: its checkpoint tensors' bytes, back to back (uint8 [handle.nbytes]); into
    `buf` (its first bytes) if given."""
    buf = torch.empty(handle.nbytes, dtype=torch.uint8) if buf is None else buf[: handle.nbytes]
    view = byte_view(buf)
    pos = 0
    for ref in handle.tensors.values():
        files.read_into(ref, view[pos : pos + ref.nbytes], expert_name(handle))
        pos += ref.nbytes
    return buf


def slot_views(handle: ExpertHandle, w13_out: torch.Tensor, w2_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where each of the expert's checkpoint tensors goes in its pool slot: gate rows then up rows (or the fused
    gate_up) in w13, down in w2."""
    if "gate_up" in handle.tensors:
        return {"gate_up": w13_out, "down": w2_out}
    width = handle.tensors["gate"].shape[0]
    return {"gate": w13_out[:width], "up": w13_out[width:], "down": w2_out}


def read_in_place(files: ShardFiles, handle: ExpertHandle, w13_out: torch.Tensor, w2_out: torch.Tensor) -> bool:
    """Read an expert's checkpoint tensors straight into its pool slot views when the bytes are already the slot's
    (same dtype and layout): no buffer between the file and the pool, so a miss allocates nothing (large transient
    buffers, one per miss, fragmented the heap: ~100 MiB of peak RSS on a 2.4 GB model). -> False if not possible."""
    if handle.layout != "linear":  # (its tensors need transposing or expanding)
        return False
    views = slot_views(handle, w13_out, w2_out)
    if not all(fits_in_place(handle.tensors[name], out) for name, out in views.items()):
        return False
    for name, out in views.items():
        files.read_into(handle.tensors[name], byte_view(out), expert_name(handle))
    return True


def split_native(handle: ExpertHandle, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tier-0 stored form -> the expert's tensors as stored, by name (views of `buf`)."""
    stored, pos = {}, 0
    for name, ref in handle.tensors.items():
        stored[name] = buf[pos : pos + ref.nbytes].view(DTYPES[ref.dtype]).view(ref.shape)
        pos += ref.nbytes
    return stored


def decode_native(handle: ExpertHandle, buf: torch.Tensor, w13_out: torch.Tensor, w2_out: torch.Tensor) -> None:
    """Tier-0 stored form -> pool slot views, converting to the pool's dtype exactly as `Tensor.to` does (other
    layouts than "linear": as `read_expert` does, through `expert_tensors`)."""
    stored = split_native(handle, buf)
    if handle.layout != "linear":
        w13, w2 = expert_tensors(stored, handle, w13_out.dtype)
        copy_blocks(w13_out, w13)
        copy_blocks(w2_out, w2)
        return
    views = slot_views(handle, w13_out, w2_out)
    for name, tensor in stored.items():
        copy_blocks(views[name], tensor)


def copy_blocks(out: torch.Tensor, src: torch.Tensor) -> None:
    """`out.copy_(src)` for 2-D tensors, in `row_blocks` (see there why)."""
    for block in row_blocks(*out.shape):
        out[block].copy_(src[block])


# Per float dtype: the same-sized integer dtype and its exponent bits (all set: inf or NaN).
EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}


FINITE_CHUNK = 1 << 16  # values masked at a time, into a per-thread scratch that stays in the core's cache
_scratch = threading.local()


def all_finite(t: torch.Tensor) -> bool:
    """No inf or NaN in a contiguous float tensor, tested on its bits with numpy (no OpenMP team): a chunk's
    exponent bits, masked into a cached scratch, reach the all-set value only where one is inf or NaN. One pass over
    the tensor: ~0.55 ms for a 9.4 MB bf16 expert here, against ~1.4 ms for whole-tensor temporaries and ~10x that
    for `torch.isfinite(t).all()`; the I/O threads that run it share the cores with decode."""
    int_dtype, exponent = EXPONENT_BITS[t.dtype]
    bits = t.reshape(-1).view(int_dtype).numpy()
    scratch = getattr(_scratch, str(int_dtype), None)
    if scratch is None:
        scratch = np.empty(FINITE_CHUNK, dtype=bits.dtype)
        setattr(_scratch, str(int_dtype), scratch)
    for start in range(0, bits.size, FINITE_CHUNK):
        part = bits[start : start + FINITE_CHUNK]
        masked = scratch[: part.size]
        np.bitwise_and(part, exponent, out=masked)
        if masked.max() == exponent:
            return False
    return True


def shard_fingerprint(handles: dict[int, list[ExpertHandle]]) -> list[list[object]]:
    return file_fingerprint(
        sorted({Path(ref.path) for hs in handles.values() for h in hs for ref in h.tensors.values()})
    )


class TierFile:
    """All experts at one quantised tier, in handle order (MoE layers ascending, experts ascending)."""

    def __init__(
        self, path: Path, codec: ExpertCodec, order: dict[tuple[int, int], int], crcs: list[int], bounce: Bounce
    ) -> None:
        self.path, self.codec, self._order, self._crcs = path, codec, order, crcs
        self._file = UncachedFile(str(path), bounce)

    @classmethod
    def open_or_build(
        cls, handles: dict[int, list[ExpertHandle]], codec: ExpertCodec, folder: Path, files: ShardFiles,
        prefix: str = "", progress: bool = False,
    ) -> TierFile:  # fmt: skip
        """The tier file `<folder>/<prefix>experts-<tier>.bin` (and its `.json` index), built first unless it is there
        and was built from these shards at this codec (a progress bar on stderr while it builds, with `progress`)."""
        name = TIER_NAMES[codec.tier]
        bin_path, index_path = folder / f"{prefix}experts-{name}.bin", folder / f"{prefix}experts-{name}.json"
        keys = [(h.layer, h.expert) for layer in sorted(handles) for h in handles[layer]]
        order = {k: i for i, k in enumerate(keys)}
        fingerprint = shard_fingerprint(handles)
        if index_path.is_file() and bin_path.is_file():
            index = json.loads(index_path.read_text())
            if (
                index.get("version") == TIER_FILE_VERSION
                and index.get("quantizer", 3) == QUANTIZER_VERSION
                and index.get("fingerprint") == fingerprint
                and index.get("blob_bytes") == codec.nbytes
                and bin_path.stat().st_size == codec.nbytes * len(keys)
            ):
                return cls(bin_path, codec, order, [int(c) for c in index["crcs"]], files.bounce)
        log.info("building the %s tier file for %d experts: %s", name, len(keys), bin_path)
        crcs = build_tier_file(handles, codec, files, bin_path, progress)
        body = {"version": TIER_FILE_VERSION, "quantizer": QUANTIZER_VERSION, "tier": name, "blob_bytes": codec.nbytes,
                "fingerprint": fingerprint}  # fmt: skip
        tmp = index_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**body, "crcs": crcs}))
        os.replace(tmp, index_path)
        return cls(bin_path, codec, order, crcs, files.bounce)

    def read(self, handle: ExpertHandle, buf: torch.Tensor | None = None) -> torch.Tensor:
        """The expert's blob (uint8 [codec.nbytes]), into `buf` if given (exactly that long)."""
        buf = torch.empty(self.codec.nbytes, dtype=torch.uint8) if buf is None else buf
        self.read_into(handle, (buf,))
        return buf

    def read_into(self, handle: ExpertHandle, parts: tuple[torch.Tensor, ...]) -> None:
        """The expert's blob, read straight into `parts` (contiguous tensors whose bytes, back to back, are the
        blob's: its pool slot's parts), CRC-checked."""
        i, n = self._order[(handle.layer, handle.expert)], self.codec.nbytes
        views = [byte_view(part) for part in parts]
        try:
            got = self._file.pread(views, i * n)
        except OSError as e:
            raise ExpertReadError(f"{expert_name(handle)}: cannot read tier file {self.path}: {e}") from None
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        if got != n or crc != self._crcs[i]:
            raise ExpertReadError(f"{expert_name(handle)}: tier file {self.path} is truncated or corrupt (delete it)")

    def close(self) -> None:
        self._file.close()


def build_tier_file(
    handles: dict[int, list[ExpertHandle]], codec: ExpertCodec, files: ShardFiles, path: Path, progress: bool = False
) -> list[int]:
    """Encode every expert (read at tier 0) into `path`, written atomically; -> CRC-32 per expert. With `progress`, a
    bar on stderr counts the experts, shown as the loads' bars are (after a second, cleared at the end)."""
    from tqdm import tqdm

    crcs: list[int] = []
    tmp = path.with_suffix(".bin.tmp")
    total = sum(len(hs) for hs in handles.values())
    desc = f"building the {TIER_NAMES[codec.tier]} tier file"
    with open(tmp, "wb") as f, tqdm(total=total, desc=desc, unit="expert", disable=not progress, leave=False,
                                    delay=1.0) as bar:  # fmt: skip
        for layer in sorted(handles):
            for handle in handles[layer]:
                hidden, width = handle.dims
                w13 = torch.empty(2 * width, hidden)
                w2 = torch.empty(hidden, width)
                decode_native(handle, read_native(files, handle), w13, w2)
                blob = codec.encode(w13, w2).numpy()
                crcs.append(zlib.crc32(blob.data))
                f.write(blob.tobytes())
                bar.update(1)
    os.replace(tmp, path)
    return crcs


class HostCache:
    """Stored forms of experts in host RAM, keyed (layer, expert, tier), under `budget` bytes (LRU); `cost(n)`: the
    bytes a buffer of n bytes really takes (default n)."""

    def __init__(self, budget: int, cost: Callable[[int], int] = int) -> None:
        self.budget, self.cost = budget, cost
        self.nbytes = 0
        self._items: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[int, int, int]) -> torch.Tensor | None:
        with self._lock:
            buf = self._items.get(key)
            if buf is not None:
                self._items.move_to_end(key)
            return buf

    def put(self, key: tuple[int, int, int], buf: torch.Tensor) -> None:
        n = self.cost(buf.numel())
        if n > self.budget:
            return
        with self._lock:
            if key in self._items:
                return
            while self.nbytes + n > self.budget:
                _, old = self._items.popitem(last=False)
                self.nbytes -= self.cost(old.numel())
            self._items[key] = buf
            self.nbytes += n


class Storage:
    """Every storage level of one model together: `load_into` puts an expert, at a tier, into a pool slot (or host
    tensors shaped as its parts: transfer.py). `progress`: a bar on stderr while a tier file builds; `transfer`: whose
    host buffers hold the host cache's copies (None: plain host memory)."""

    def __init__(
        self, handles: dict[int, list[ExpertHandle]], host_bytes: int, check_finite: bool, progress: bool = False,
        transfer: Transfer | None = None,
    ) -> None:  # fmt: skip
        self.handles, self.check_finite, self.progress = handles, check_finite, progress
        self.transfer = Transfer() if transfer is None else transfer
        self.files = ShardFiles()
        self.host = HostCache(host_bytes, self.transfer.host_bytes)
        first = Path(next(iter(handles.values()))[0].path)
        self.model_folder = first.parent
        self.tier_prefix = f"{model_name(first)}." if is_gguf(first) else ""  # (a GGUF's tier files carry its name)
        own = codes_tier(handles)
        self.codes_tier = None if own is None else own[0]  # the tier read from the model's own blocks
        self._tiers: dict[int, TierFile] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def tier_source(self, tier: int) -> TierFile | None:
        """The tier file of a quantised tier, built on first use; None for tier 0 and the codes tier (the shards
        themselves)."""
        if tier in (0, self.codes_tier):
            return None
        with self._lock:
            if tier not in self._tiers:
                hidden, width = next(iter(self.handles.values()))[0].dims
                codec = ExpertCodec(tier, width, hidden)
                try:
                    folder = cache_dir(self.model_folder)
                    self._tiers[tier] = TierFile.open_or_build(self.handles, codec, folder, self.files,
                                                               self.tier_prefix, self.progress)  # fmt: skip
                except OSError as e:
                    raise ModelLoadError(f"cannot build the {TIER_NAMES[tier]} tier file of {self.model_folder} "
                                         f"(in its .moelane/ folder, else ~/.cache/moelane): {e}; --default-tier "
                                         "native reads the experts as the model stores them") from None  # fmt: skip
            return self._tiers[tier]

    def load_into(self, handle: ExpertHandle, tier: int, parts: tuple[torch.Tensor, ...]) -> tuple[str, int]:
        """Fetch the expert's stored form at `tier` (host RAM, else disk) into its pool slot's `parts` (`tiers.
        slot_parts`: w13, w2 at tier 0; codes and scales at a quantised tier). -> (level, bytes read)."""
        if tier == 0:
            return self._load_native(handle, parts[0], parts[1])
        if tier == self.codes_tier:
            return self._load_codes(handle, parts)
        source = self.tier_source(tier)
        assert source is not None
        cache_key = (handle.layer, handle.expert, tier)
        buf, level = self.host.get(cache_key), "host"
        in_place = all(part.dim() == 2 for part in parts)  # else interleaved parts (tiers.slot_parts): via a buffer
        if buf is None and self.host.budget == 0:
            level = "disk"
            if in_place:
                source.read_into(handle, parts)
            else:
                buf = source.read(handle, self._scratch(source.codec.nbytes)[: source.codec.nbytes])
        elif buf is None:
            level = "disk"
            buf = source.read(handle, self.transfer.host_buffer(source.codec.nbytes))
            self.host.put(cache_key, buf)
        if buf is not None:
            pos = 0
            for part in parts:
                n = part.numel() * part.element_size()
                fill_part(part, buf[pos : pos + n])
                pos += n
        if self.check_finite and not all(all_finite(scales) for scales in parts[1::2]):
            raise ExpertReadError(f"{expert_name(handle)}: non-finite scales read from {source.path} (corrupt file?)")
        return level, source.codec.nbytes

    def _load_native(self, handle: ExpertHandle, w13: torch.Tensor, w2: torch.Tensor) -> tuple[str, int]:
        cache_key = (handle.layer, handle.expert, 0)
        buf, level = self.host.get(cache_key), "host"
        if buf is None and self.host.budget == 0:
            # Nothing to keep in host RAM: straight into the slot, or through this thread's reused buffer (one big
            # buffer a miss, allocated and freed, fragmented the heap: ~100 MiB of peak RSS on a 2.4 GB model).
            level = "disk"
            if not read_in_place(self.files, handle, w13, w2):
                buf = read_native(self.files, handle, self._scratch(handle.nbytes))
        elif buf is None:
            level = "disk"
            buf = read_native(self.files, handle, self.transfer.host_buffer(handle.nbytes))
            self.host.put(cache_key, buf)
        if buf is not None:  # (None: read in place)
            decode_native(handle, buf, w13, w2)
        if self.check_finite and not (all_finite(w13) and all_finite(w2)):
            raise ExpertReadError(f"{expert_name(handle)}: non-finite weights read from {handle.path} (corrupt file?)")
        return level, handle.nbytes

    def _load_codes(self, handle: ExpertHandle, parts: tuple[torch.Tensor, ...]) -> tuple[str, int]:
        """The expert's blocks from the file (or host RAM) repacked into its slot's codes and scales."""
        cache_key = (handle.layer, handle.expert, self.codes_tier or 0)
        buf, level = self.host.get(cache_key), "host"
        if buf is None:
            level = "disk"
            cached = self.host.budget > 0
            into = self.transfer.host_buffer(handle.nbytes) if cached else self._scratch(handle.nbytes)
            buf = read_native(self.files, handle, into)
            if cached:
                self.host.put(cache_key, buf)
        if all(part.dim() == 2 for part in parts):
            expert_codes_into(handle, split_native(handle, buf), parts)
        else:  # interleaved parts (tiers.slot_parts): the codes row-major first
            rows = tuple(rows_major_part(part) for part in parts)
            expert_codes_into(handle, split_native(handle, buf), rows)
            for part, row_part in zip(parts, rows, strict=True):
                if row_part is not part:
                    interleave_into(part, row_part)
        if self.check_finite and not all(all_finite(scales) for scales in parts[1::2]):
            raise ExpertReadError(f"{expert_name(handle)}: non-finite scales read from {handle.path} (corrupt file?)")
        return level, handle.nbytes

    def _scratch(self, n_bytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `n_bytes` owned by the calling thread, kept for its next read."""
        buf: torch.Tensor | None = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < n_bytes:
            buf = self._local.buf = torch.empty(n_bytes, dtype=torch.uint8)
        return buf

    def close(self) -> None:
        self.files.close()
        with self._lock:
            for tier_file in self._tiers.values():
                tier_file.close()
