"""Precision tiers: each expert can be stored, streamed and held resident at tier 0 (native: the compute dtype in the
pool, the checkpoint's own form on disk), int8 or int4.

Quantisation is symmetric and group-wise along each weight row (the input dimension), one float16 scale per group:
int8 uses groups of 64 and codes in [-127, 127]; int4 groups of 32 and codes in [-8, 7], two codes per byte (low
nibble first), stored offset by 8. A row whose length is not a multiple of the group uses half or a quarter of it
when that divides the row (at least 16), else is zero-padded to whole groups.
Quantisation happens once per expert (see `storage.TierFile`). A quantised expert stays quantised in the pool: its
slot holds its codes and scales as they are stored (`slot_parts`, the pool formats of `moelane.model.provider`), and
compute dequantises them (`moelane.model.experts`). A lower tier so saves pool bytes as well as storage, host RAM and
bytes read per miss, and costs the rounding error measured as held-out perplexity (docs/pager.md).

A GGUF's Q8_0 (Q4_0) experts are held at int8 (int4) as the file's own codes (`model.gguf.codes`): that tier's
pool then has the file's format (`tier_format`: int8 in groups of 32 for Q8_0), its stored form is the file's blocks,
and no tier file is built for it. `--default-tier auto` (the default) is that tier for such a file; for a GGUF of
other block types (K-quants, ...), the tier nearest most of its experts' weights (`blocks.NEAREST_TIER`), whose tier
file is built once from the values the `gguf` package decodes; native otherwise.

An expert's stored form at tier > 0 (from a tier file) is one flat uint8 blob: q13 | s13 | q2 | s2 (w13 [2I, H], w2 [H,
I]), exactly the bytes of its four slot parts back to back (interleaved on the CPU where `slot_parts` says: the same
bytes in another order); its size is fixed by the shapes, so a cache file holds experts at fixed offsets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moelane.kernels.formats import FORMATS, QuantFormat, dequantize, quantize
from moelane.kernels.pool import BLOCK_ROWS, interleave_into, interleaved_shape, interleaves
from moelane.model.checkpoint import ExpertHandle
from moelane.model.gguf.blocks import NEAREST_TIER
from moelane.model.gguf.codes import codes_tier
from moelane.model.layers import GRAIN  # torch runs element-wise work of at most this many elements unthreaded
from moelane.model.provider import TIER_KINDS


def row_blocks(n_rows: int, n_cols: int) -> Iterator[slice]:
    """Row ranges of at most GRAIN elements each (one row at least).

    The store's I/O threads decode and check experts in such blocks: a torch op over more than GRAIN elements starts
    an OpenMP team of the calling thread's own, and while such a thread lives every parallel op of the compute thread
    ran ~3x slower here (2 cores; 8-10x on whole decode steps), though the I/O thread itself sat idle."""
    step = max(1, GRAIN // max(1, n_cols))
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


TIER_NAMES = TIER_KINDS  # ("native", "int8", "int4"): tier t's name is the kind of its pools
TIER_ALIASES = {"0": 0, "native": 0, "tier0": 0, "1": 1, "int8": 1, "2": 2, "int4": 2}
AUTO = "auto"  # the default tier: a GGUF's Q8_0 / Q4_0 experts' codes' tier, other block types' nearest, else native


def parse_tier(text: str | int) -> int:
    """'native' / 'int8' / 'int4' (or 0 / 1 / 2) -> tier index."""
    key = str(text).strip().lower()
    if key not in TIER_ALIASES:
        raise ValueError(f"unknown precision tier {text!r}; use one of {', '.join(TIER_NAMES)}")
    return TIER_ALIASES[key]


def check_default_tier(text: str | int) -> None:
    """ValueError unless `text` is a tier or 'auto'."""
    if str(text).strip().lower() != AUTO:
        parse_tier(text)


def default_tier(text: str | int, handles: dict[int, list[ExpertHandle]]) -> int:
    """The tier a default of `text` holds these experts at: 'auto' is the tier of their own codes (a GGUF's Q8_0:
    int8, Q4_0: int4), else `nearest_tier`; a named tier is itself (native decodes any GGUF to the compute dtype)."""
    if str(text).strip().lower() != AUTO:
        return parse_tier(text)
    own = codes_tier(handles)
    return nearest_tier(handles) if own is None else own[0]


def nearest_tier(handles: dict[int, list[ExpertHandle]]) -> int:
    """The quantised tier nearest most of these experts' weights where every expert tensor is of a block type that
    has one (`NEAREST_TIER`: a GGUF's K-quants and others; a tie goes to int8), else native (float types, MXFP4, no
    experts). A GGUF layer's experts are slices of the same stacked tensors, so its first one stands for all (any
    other checkpoint's first expert is of a float type: native)."""
    weights = dict.fromkeys(FORMATS, 0)  # tier -> weights nearest it
    for layer_handles in handles.values():
        for ref in layer_handles[0].tensors.values() if layer_handles else ():
            if ref.dtype not in NEAREST_TIER:
                return 0
            weights[NEAREST_TIER[ref.dtype]] += math.prod(ref.value_shape) * len(layer_handles)
    if not any(weights.values()):
        return 0
    return max(weights, key=lambda tier: (weights[tier], -tier))


def tier_format(tier: int, handles: dict[int, list[ExpertHandle]]) -> QuantFormat:
    """Quantised tier `tier`'s format for these experts: the file's (their own codes' tier), else `FORMATS[tier]`."""
    own = codes_tier(handles)
    return own[1] if own is not None and own[0] == tier else FORMATS[tier]


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, cols: int, fmt: QuantFormat) -> None:
    """`out.copy_(dequantize(...))`, in `row_blocks` (the same values: every step is element-wise)."""
    rows, n_groups = scales.shape
    by_row = codes.view(rows, -1)
    for block in row_blocks(rows, n_groups * fmt.group_for(cols)):
        out[block].copy_(dequantize(by_row[block].reshape(-1), scales[block], cols, fmt))


@dataclass(frozen=True, slots=True)
class ExpertCodec:
    """Blob layout of one expert at a quantised tier. width I, hidden H (w13 [2I, H], w2 [H, I])."""

    tier: int
    width: int
    hidden: int

    def __post_init__(self) -> None:
        if self.tier not in FORMATS:
            raise ValueError(f"tier {self.tier} is not a quantised tier (1 = int8, 2 = int4)")
        if self.width < 1 or self.hidden < 1:
            raise ValueError(f"bad expert shape I={self.width} H={self.hidden}")

    @property
    def fmt(self) -> QuantFormat:
        return FORMATS[self.tier]

    def _parts(self) -> list[int]:
        (r13, c13), (r2, c2) = (2 * self.width, self.hidden), (self.hidden, self.width)
        f = self.fmt
        return [f.code_bytes(r13, c13), f.scale_bytes(r13, c13), f.code_bytes(r2, c2), f.scale_bytes(r2, c2)]

    @property
    def nbytes(self) -> int:
        return sum(self._parts())

    def encode(self, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """One expert's tier-0 weights -> its blob (uint8 [nbytes])."""
        q13, s13 = quantize(w13, self.fmt)
        q2, s2 = quantize(w2, self.fmt)
        blob = torch.cat([q13, s13.view(torch.uint8).reshape(-1), q2, s2.view(torch.uint8).reshape(-1)])
        assert blob.numel() == self.nbytes
        return blob

    def decode_into(self, blob: torch.Tensor, w13_out: torch.Tensor, w2_out: torch.Tensor) -> None:
        """Dequantise a blob into pool slot views w13_out [2I, H], w2_out [H, I] (any float dtype)."""
        a, b, c, _ = self._parts()
        q13, s13, q2, s2 = blob[:a], blob[a : a + b], blob[a + b : a + b + c], blob[a + b + c :]
        f = self.fmt
        n13, n2 = f.n_groups(self.hidden), f.n_groups(self.width)
        s13h = s13.view(torch.float16).view(2 * self.width, n13)
        s2h = s2.view(torch.float16).view(self.hidden, n2)
        dequantize_into(w13_out, q13, s13h, self.hidden, f)
        dequantize_into(w2_out, q2, s2h, self.width, f)


Part = tuple[torch.dtype, tuple[int, ...]]  # one tensor of a pool slot: its dtype and shape


def slot_parts(
    tier: int, hidden: int, width: int, dtype: torch.dtype, fmt: QuantFormat | None = None, interleave: bool = False
) -> tuple[Part, ...]:
    """The tensors of one expert's pool slot at `tier`: native (w13 [2I, H], w2 [H, I]) in the compute `dtype`;
    quantised (codes13, scales13, codes2, scales2) in `fmt` (default `FORMATS[tier]`; see `tier_format`), in the
    order and with the bytes of its blob (`ExpertCodec`). With `interleave` (the CPU's pools), int8 matrices whose rows
    come in whole blocks have their codes and scales interleaved (`kernels.pool`: 3-D parts; `fill_part`)."""
    if tier == 0:
        return (dtype, (2 * width, hidden)), (dtype, (hidden, width))
    fmt = FORMATS[tier] if fmt is None else fmt
    parts: list[Part] = []
    code_dtype = torch.int8 if fmt.bits == 8 else torch.uint8
    for rows, cols in ((2 * width, hidden), (hidden, width)):
        padded = fmt.n_groups(cols) * fmt.group_for(cols)
        widths = ((code_dtype, padded * fmt.bits // 8), (torch.float16, fmt.n_groups(cols)))
        if interleave and interleaves("int8" if fmt.bits == 8 else "int4", rows):
            parts += [(dt, interleaved_shape(rows, n, dt)) for dt, n in widths]
        else:
            parts += [(dt, (rows, n)) for dt, n in widths]
    return tuple(parts)


def fill_part(part: torch.Tensor, stored: torch.Tensor) -> None:
    """A slot part (`slot_parts`) from its bytes in an expert's stored blob (uint8, row-major as the blob holds it):
    copied, or interleaved where the part is (3-D)."""
    if part.dim() == 3:
        rows = part.shape[0] * BLOCK_ROWS
        interleave_into(part, stored.view(part.dtype).view(rows, -1))
    else:
        part.view(-1).view(torch.uint8).copy_(stored)


def rows_major_part(part: torch.Tensor) -> torch.Tensor:
    """An empty row-major tensor for a slot part's values: `part` itself where it is row-major (2-D), else a new
    [rows, cols] tensor (its contents are not copied)."""
    if part.dim() == 2:
        return part
    cols = part.shape[1] * (4 if part.dtype == torch.int8 else 1)
    return torch.empty(part.shape[0] * BLOCK_ROWS, cols, dtype=part.dtype)


def slot_bytes(tier: int, hidden: int, width: int, dtype: torch.dtype, fmt: QuantFormat | None = None) -> int:
    """The bytes of one expert's pool slot at `tier` in `fmt` (quantised: its blob's size)."""
    return sum(dt.itemsize * math.prod(shape) for dt, shape in slot_parts(tier, hidden, width, dtype, fmt))


def expert_slot_bytes(tier: int, handles: dict[int, list[ExpertHandle]], dtype: torch.dtype) -> int:
    """`slot_bytes` of these experts (their dims; the tier's format for them, `tier_format`)."""
    dims = next(h for hs in handles.values() for h in hs).dims
    return slot_bytes(tier, *dims, dtype, tier_format(tier, handles) if tier else None)
