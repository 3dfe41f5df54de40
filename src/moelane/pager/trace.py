"""Routing traces: a compact, streamed file of segment records (docs/design.md#the-pager; layout in
docs/trace-format.md).

A trace is a file header (model shape, bytes per expert at each precision tier) followed by one record per segment
(forward pass), which may also carry the next-layer look-ahead's predictions (docs/design.md#prediction-and-prefetch) so
that replay can prefetch as the live store does. Each record is self-delimiting and checksummed and is flushed when
written, so a trace cut short by a crash reads back to its last whole segment (the file is created at the first segment,
so a run that fails before recording anything leaves an earlier file in place). In memory a trace is a few numpy arrays
indexed by token, with segment boundaries as offsets; `Segment` is a view of one forward pass. Shapes: N tokens, S
segments, L MoE layers, K top-k.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from moelane.errors import MoelaneError

log = logging.getLogger(__name__)

MAGIC = b"MLTRACE1"
SEG_MAGIC = b"SEGR"
SEG_STRUCT = struct.Struct("<4sIIIII")  # magic, index, n_tokens, meta_len, payload_len, crc32(meta + payload)
MAX_EXPERTS = 1 << 16  # expert ids are stored in 8 bits up to 256 experts a layer, else in 16
PHASES = ("prefill", "decode", "mixed", "unknown")

IntArray = npt.NDArray[np.int64]


class TraceError(MoelaneError):
    """A trace file that cannot be read (not a trace, unsupported version, bad header)."""


@dataclass(frozen=True, slots=True)
class TraceHeader:
    """Model shape of a trace. `tiers` lists (precision name, bytes per expert), tier 0 first."""

    n_layers: int
    n_experts: int
    top_k: int
    tiers: tuple[tuple[str, int], ...]
    moe_layers: tuple[int, ...] = ()
    model: str = ""

    def __post_init__(self) -> None:
        if self.n_layers < 1 or self.n_experts < 1 or not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"bad trace shape L={self.n_layers} E={self.n_experts} K={self.top_k}")
        if self.n_experts > MAX_EXPERTS:
            raise ValueError(f"{self.n_experts} experts a layer: a trace holds at most {MAX_EXPERTS} (16-bit ids)")
        if not self.tiers or any(b <= 0 for _, b in self.tiers):
            raise ValueError(f"tiers must be non-empty with positive byte sizes, got {self.tiers}")

    @property
    def n_total(self) -> int:
        """Number of distinct expert ids (layer, expert) = L * E."""
        return self.n_layers * self.n_experts

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert at tier 0."""
        return self.tiers[0][1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "top_k": self.top_k,
            "tiers": [list(t) for t in self.tiers],
            "moe_layers": list(self.moe_layers),
            "model": self.model,
        }

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> TraceHeader:
        if body.get("version") != 1:
            raise TraceError(f"unsupported trace version {body.get('version')!r}")
        return cls(
            n_layers=int(body["n_layers"]),
            n_experts=int(body["n_experts"]),
            top_k=int(body["top_k"]),
            tiers=tuple((str(n), int(b)) for n, b in body["tiers"]),
            moe_layers=tuple(int(x) for x in body.get("moe_layers", [])),
            model=str(body.get("model", "")),
        )

    def id_dtype(self) -> type[np.unsignedinteger[Any]]:
        return np.uint8 if self.n_experts <= 256 else np.uint16


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    """One forward pass. expert_ids [T, L, K], weights [T, L, K] or None, stream_ids [T]. lookahead [T, L-1, K] or
    None: per token, layer l+1's router applied to the input of layer l's MoE block (its top-K), i.e. the experts the
    live store prefetches for layer l+1 while layer l computes."""

    index: int
    phase: str
    expert_ids: npt.NDArray[Any]
    stream_ids: IntArray
    weights: npt.NDArray[np.float32] | None = None
    lookahead: npt.NDArray[Any] | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    def flat_ids(self, n_experts: int) -> IntArray:
        """Distinct flat expert ids `layer * E + expert` routed by this segment, sorted."""
        return np.unique(token_flat_ids(self.expert_ids, n_experts))

    def size(self, n_experts: int) -> int:
        """Number of distinct experts routed (the segment's size: docs/design.md#the-boundary-and-the-warm-start)."""
        return int(self.flat_ids(n_experts).size)


def token_flat_ids(expert_ids: npt.NDArray[Any], n_experts: int) -> IntArray:
    """[T, L, K] expert ids -> [T, L, K] flat ids `layer * E + expert` (int64)."""
    n_layers = expert_ids.shape[1]
    offsets = (np.arange(n_layers, dtype=np.int64) * n_experts)[None, :, None]
    return expert_ids.astype(np.int64) + offsets


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    """A whole trace in memory. expert_ids/weights [N, L, K]; seg_offsets [S+1]; stream_ids [N]; lookahead
    [N, L-1, K], kept only when every segment carries it (else None)."""

    header: TraceHeader
    expert_ids: npt.NDArray[Any]
    weights: npt.NDArray[np.float32]
    seg_offsets: IntArray
    seg_index: IntArray
    seg_phase: tuple[str, ...]
    stream_ids: IntArray
    lookahead: npt.NDArray[Any] | None = None

    @property
    def n_segments(self) -> int:
        return len(self.seg_phase)

    @property
    def n_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    def segment(self, s: int) -> Segment:
        a, b = int(self.seg_offsets[s]), int(self.seg_offsets[s + 1])
        return Segment(
            index=int(self.seg_index[s]),
            phase=self.seg_phase[s],
            expert_ids=self.expert_ids[a:b],
            stream_ids=self.stream_ids[a:b],
            weights=self.weights[a:b],
            lookahead=None if self.lookahead is None else self.lookahead[a:b],
        )

    def segments(self) -> Iterator[Segment]:
        for s in range(self.n_segments):
            yield self.segment(s)


def _encode_streams(stream_ids: IntArray) -> list[list[int]]:
    runs: list[list[int]] = []
    for sid in stream_ids.tolist():
        if runs and runs[-1][0] == sid:
            runs[-1][1] += 1
        else:
            runs.append([int(sid), 1])
    return runs


class TraceWriter:
    """Appends segment records to a trace file; each record is flushed as written. Use as a context manager. The
    file is created at the first segment (or at a clean close with none), so a run that fails before recording
    anything leaves an earlier file at `path` as it was."""

    def __init__(self, path: str | Path, header: TraceHeader, level: int = 1) -> None:
        self.header = header
        self.path = Path(path)
        self._level = level
        self._next_index = 0
        self._f: BinaryIO | None = None

    def _file(self) -> BinaryIO:
        if self._f is None:
            try:
                self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
            except OSError as e:
                raise TraceError(f"cannot write a trace to {self.path}: {e.strerror or e}") from None
            body = json.dumps(self.header.to_dict()).encode()
            self._f.write(MAGIC + struct.pack("<I", len(body)) + body)
            self._f.flush()
        return self._f

    def write_segment(
        self,
        expert_ids: npt.NDArray[Any],
        weights: npt.NDArray[Any] | None,
        phase: str,
        stream_ids: npt.NDArray[Any] | None = None,
        lookahead: npt.NDArray[Any] | None = None,
    ) -> int:
        """Append one segment ([T, L, K] ids and gate weights, optional [T, L-1, K] look-ahead); returns its index."""
        h = self.header
        ids = np.asarray(expert_ids)
        if ids.ndim != 3 or ids.shape[1:] != (h.n_layers, h.top_k):
            raise ValueError(f"expert_ids must be [T, {h.n_layers}, {h.top_k}], got {ids.shape}")
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        n_tokens = ids.shape[0]
        extra = b""
        if lookahead is not None:
            ahead = np.asarray(lookahead)
            if ahead.shape != (n_tokens, h.n_layers - 1, h.top_k):
                raise ValueError(f"lookahead must be [{n_tokens}, {h.n_layers - 1}, {h.top_k}], got {ahead.shape}")
            extra = ahead.astype(h.id_dtype()).tobytes()
        w = np.zeros(ids.shape, np.float32) if weights is None else np.asarray(weights, np.float32)
        scale = float(max(float(np.abs(w).max(initial=0.0)), 1e-30))
        q = np.clip(np.rint(w / scale * 255.0), 0, 255).astype(np.uint8)
        sids = np.zeros(n_tokens, np.int64) if stream_ids is None else np.asarray(stream_ids, np.int64)
        body: dict[str, Any] = {"phase": phase, "scale": scale, "streams": _encode_streams(sids)}
        if lookahead is not None:
            body["lookahead"] = True
        meta = json.dumps(body).encode()
        payload = zlib.compress(ids.astype(h.id_dtype()).tobytes() + q.tobytes() + extra, self._level)
        index = self._next_index
        crc = zlib.crc32(payload, zlib.crc32(meta))
        f = self._file()
        f.write(SEG_STRUCT.pack(SEG_MAGIC, index, n_tokens, len(meta), len(payload), crc) + meta + payload)
        f.flush()
        self._next_index += 1
        return index

    def close(self, failed: bool = False) -> None:
        """Finish the trace; after a failure with nothing recorded, leave `path` untouched."""
        if self._f is None and not failed:
            self._file()
        if self._f is not None:
            self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _read_header(f: BinaryIO, path: Path) -> TraceHeader:
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise TraceError(f"{path}: not a moelane trace (bad magic)")
    (n,) = struct.unpack("<I", head[len(MAGIC) :])
    body = f.read(n)
    if len(body) < n:
        raise TraceError(f"{path}: truncated trace header")
    try:
        return TraceHeader.from_dict(json.loads(body))
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{path}: bad trace header: {e}") from e


def iter_segments(path: str | Path) -> tuple[TraceHeader, Iterator[Segment]]:
    """Header and a lazy iterator over whole segments; stops (with a warning) at a torn or corrupt record."""
    path = Path(path)
    f = open(path, "rb")  # noqa: SIM115 - closed by the generator
    try:
        header = _read_header(f, path)
    except BaseException:
        f.close()
        raise
    shape_tail = (header.n_layers, header.top_k)
    id_dtype = header.id_dtype()

    def gen() -> Iterator[Segment]:
        with f:
            while True:
                fixed = f.read(SEG_STRUCT.size)
                if not fixed:
                    return
                if len(fixed) < SEG_STRUCT.size:
                    log.warning("%s: trace cut short inside a record header; read up to the last whole segment", path)
                    return
                magic, index, n_tokens, meta_len, payload_len, crc = SEG_STRUCT.unpack(fixed)
                meta, payload = f.read(meta_len), f.read(payload_len)
                if magic != SEG_MAGIC or len(meta) < meta_len or len(payload) < payload_len:
                    log.warning("%s: trace cut short at segment %d; read up to the last whole segment", path, index)
                    return
                if zlib.crc32(payload, zlib.crc32(meta)) != crc:
                    log.warning("%s: checksum mismatch at segment %d; stopping there", path, index)
                    return
                m = json.loads(meta)
                raw = zlib.decompress(payload)
                n_ids = n_tokens * shape_tail[0] * shape_tail[1]
                id_bytes = n_ids * np.dtype(id_dtype).itemsize
                ids = np.frombuffer(raw, id_dtype, count=n_ids).reshape(n_tokens, *shape_tail)
                q = np.frombuffer(raw, np.uint8, count=n_ids, offset=id_bytes)
                w = (q.astype(np.float32) * np.float32(m["scale"] / 255.0)).reshape(ids.shape)
                sids = np.concatenate([np.full(c, s, np.int64) for s, c in m["streams"]] or [np.zeros(0, np.int64)])
                ahead = None
                if m.get("lookahead"):
                    ahead_shape = (n_tokens, shape_tail[0] - 1, shape_tail[1])
                    count = n_tokens * (shape_tail[0] - 1) * shape_tail[1]
                    ahead = np.frombuffer(raw, id_dtype, count=count, offset=id_bytes + n_ids).reshape(ahead_shape)
                yield Segment(index, m["phase"], ids, sids, w, ahead)

    return header, gen()


def read_trace(path: str | Path) -> Trace:
    """Read a whole trace into memory (up to its last whole segment)."""
    header, segs = iter_segments(path)
    return trace_from_segments(header, list(segs))


def trace_from_segments(header: TraceHeader, segs: list[Segment]) -> Trace:
    k_shape = (0, header.n_layers, header.top_k)
    counts = np.array([s.n_tokens for s in segs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Trace(
        header=header,
        expert_ids=np.concatenate([s.expert_ids for s in segs]) if segs else np.zeros(k_shape, header.id_dtype()),
        weights=(
            np.concatenate(
                [s.weights if s.weights is not None else np.zeros(s.expert_ids.shape, np.float32) for s in segs]
            )
            if segs
            else np.zeros(k_shape, np.float32)
        ),
        seg_offsets=offsets,
        seg_index=np.array([s.index for s in segs], np.int64),
        seg_phase=tuple(s.phase for s in segs),
        stream_ids=np.concatenate([s.stream_ids for s in segs]) if segs else np.zeros(0, np.int64),
        lookahead=(
            np.concatenate([s.lookahead for s in segs if s.lookahead is not None])
            if segs and all(s.lookahead is not None for s in segs)
            else None
        ),
    )


def write_trace(path: str | Path, trace: Trace) -> None:
    with TraceWriter(path, trace.header) as w:
        for seg in trace.segments():
            w.write_segment(seg.expert_ids, seg.weights, seg.phase, seg.stream_ids, seg.lookahead)
