"""Weight pools: S matrices [Out, In] in one storage format, as `gather_linear` reads them.

Shape alphabet: S slots, O output rows (Out), I input columns (In), C stored columns (I padded to whole groups),
G scale groups per row (C / group).

    kind   data                          scales
    f32    float32  [S, O, I]            None
    bf16   bfloat16 [S, O, I]            None
    int8   int8     [S, O, C]            float16 [S, O, G]   weight = code * scale of its group
    int4   uint8    [S, O, C / 2]        float16 [S, O, G]   byte j = (code 2j + 8) | (code 2j+1 + 8) << 4
    int8, interleaved:
           int8     [S, O / 16, C / 4, 64]  float16 [S, O / 16, G, 16]
                    byte 4l + t of [s, b, j] = code of row 16b + l, column 4j + t; [s, b, g, l] = row 16b + l's scale

int8 and int4 are moelane's tiers 1 and 2 (`formats.py`, the pager's tiers), exactly as `quantize` writes a matrix:
groups of 64 (int8) or 32 (int4) along I, or half / a quarter of that where it divides I (at least 16), else I is
zero-padded to whole groups. A pool's group is what its shapes say (C / G), any the kernel computes from (int8: 16, 32
or 64; int4: 16 or 32): a GGUF's Q8_0 experts are int8 in groups of 32, held as the file has them (docs/gguf.md). The
int4 layout stays tiers' own: the half-group layout the kernel study tried (byte j = code j | code j + 16 << 4) was no
faster here (one MoE layer, 2 threads: 0.95 ms tiers' against 0.98 ms on the inflated shape, 1.79 against 1.68 ms on
Qwen3-30B-A3B's), so the store needs no conversion at admission.

Interleaved int8 holds the same codes and scales as int8, 16 rows a block, 4 columns of all 16 rows a 64-byte
vector: the kernel then computes 16 rows' dot products lane by lane, with fewer instructions per weight and row, where
a round of many streams is bound by the row-major tiles' arithmetic (docs/kernels.md "Interleaved int8"). Other bits
than row-major int8 (the sums are ordered by units of min(group, 32) columns, not lanes of 4), the same for a row
whatever the call holds. The CPU's expert pools hold int8 this way wherever O is a multiple of 16 (`interleaves`);
files keep the row-major layout, and a load interleaves (`interleave_into`, ~1 ms for a 4.7 MB expert a thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelane.kernels.formats import FORMATS, QuantFormat
from moelane.kernels.formats import quantize as tier_quantize

KINDS = ("f32", "bf16", "int8", "int4")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}
QUANT = {"int8": FORMATS[1], "int4": FORMATS[2]}  # each kind's format as `quantize` writes it by default
GROUPS = {"int8": (16, 32, 64), "int4": (16, 32)}  # the groups `gather_linear` takes (csrc/gather_linear.cpp)
FLOAT_KINDS = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the kind that holds unquantised weights of a dtype


@dataclass(frozen=True, slots=True)
class Pool:
    """S weight matrices [O, I] in one format (see the module docstring). `in_features` (I) defaults to the stored
    row length for f32 / bf16; int8 / int4 need it to tell real columns from padding."""

    kind: str
    data: torch.Tensor
    scales: torch.Tensor | None = None
    in_features: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown pool kind {self.kind!r}; use one of {', '.join(KINDS)}")
        data = self.data
        if self.interleaved:
            data = data.view(data.shape[0], -1, data.shape[2] * 4)  # (for the checks: [S, O, C])
        if data.dtype != DTYPES[self.kind] or data.dim() != 3 or not data.is_contiguous():
            raise ValueError(f"a {self.kind} pool's data must be a contiguous {DTYPES[self.kind]} [S, Out, In]")
        if self.kind in QUANT:
            self._check_quantised()
        elif self.scales is not None or self.in_features not in (None, data.shape[2]):
            raise ValueError(f"a {self.kind} pool has no scales, and in_features is its rows' length")
        if self.in_features is None:
            object.__setattr__(self, "in_features", data.shape[2])

    def _check_quantised(self) -> None:
        n_in, s = self.in_features, self.scales
        if n_in is None or n_in < 1:
            raise ValueError(f"a {self.kind} pool needs in_features (the columns before padding)")
        if self.interleaved:
            if (
                s is None
                or s.dtype != torch.float16
                or s.dim() != 4
                or s.shape[3] != BLOCK_ROWS
                or (tuple(s.shape[:2]) != tuple(self.data.shape[:2]))
            ):
                raise ValueError("interleaved int8 scales must be float16 [S, Out / 16, G, 16]")
        elif s is None or s.dtype != torch.float16 or s.dim() != 3 or tuple(s.shape[:2]) != tuple(self.data.shape[:2]):
            raise ValueError(f"{self.kind} scales must be float16 [S, Out, G]")
        if not s.is_contiguous():
            raise ValueError(f"{self.kind} scales must be contiguous")
        stored, n_groups = self.cols * (2 if self.kind == "int4" else 1), s.shape[2]
        group = stored // max(1, n_groups)
        if group * n_groups != stored or group not in GROUPS[self.kind] or not 0 <= stored - n_in < group:
            groups = " / ".join(map(str, GROUPS[self.kind]))
            raise ValueError(f"{self.kind} rows of {n_in} columns must be stored padded to whole groups of {groups}, "
                             f"got {stored} in {n_groups} groups")  # fmt: skip

    @property
    def interleaved(self) -> bool:
        """Whether the pool is int8 in 16-row blocks (the module docstring)."""
        return self.kind == "int8" and self.data.dim() == 4

    @property
    def cols(self) -> int:
        """Stored elements per row: C (int4: C / 2 bytes)."""
        return int(self.data.shape[2] * 4 if self.interleaved else self.data.shape[2])

    @property
    def group(self) -> int | None:
        """Weights under one scale (int8 / int4), None for float kinds."""
        if self.scales is None:
            return None
        return int(self.cols * (2 if self.kind == "int4" else 1) // self.scales.shape[2])

    @property
    def n_slots(self) -> int:
        return int(self.data.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.data.shape[1] * (BLOCK_ROWS if self.interleaved else 1))

    def to(self, device: torch.device) -> Pool:
        """The same pool on `device` (itself where it is there already)."""
        if self.data.device == device:
            return self
        scales = None if self.scales is None else self.scales.to(device)
        return Pool(self.kind, self.data.to(device), scales, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of one slot (codes and scales): what a product reads per distinct slot."""
        scale_bytes = 0 if self.scales is None else self.scales[0].numel() * 2
        return int(self.data[0].numel() * self.data.element_size() + scale_bytes)


def padded_cols(in_features: int, fmt: QuantFormat) -> int:
    return fmt.n_groups(in_features) * fmt.group_for(in_features)


def quantize(w: torch.Tensor, kind: str, fmt: QuantFormat | None = None) -> Pool:
    """w [S, O, I] float -> a pool of `kind`. int8 / int4 codes and scales are `tiers.quantize`'s, matrix by
    matrix, in `fmt` (default: the kind's tier format, `QUANT`); f32 / bf16 are a cast."""
    if w.dim() != 3:
        raise ValueError(f"quantize takes weights [S, Out, In], got {tuple(w.shape)}")
    if kind not in QUANT:
        return Pool(kind, w.to(DTYPES[kind]).contiguous())
    fmt = QUANT[kind] if fmt is None else fmt
    if fmt.bits != (8 if kind == "int8" else 4):
        raise ValueError(f"a {kind} pool cannot hold {fmt.bits}-bit codes")
    n_slots, n_out, n_in = w.shape
    codes, scales = zip(*(tier_quantize(w[s], fmt) for s in range(n_slots)), strict=True)
    data = torch.stack(codes).view(n_slots, n_out, -1)
    if kind == "int8":
        data = data.view(torch.int8)
    return Pool(kind, data.contiguous(), torch.stack(scales).contiguous(), n_in)


def dequantize(pool: Pool) -> torch.Tensor:
    """The pool's weights as float32 [S, O, I] (every value exact: codes times fp16 scales fit fp32)."""
    if pool.kind not in QUANT:
        return pool.data.float()
    assert pool.scales is not None and pool.in_features is not None
    data, scales = rows_major(pool.data, pool.scales) if pool.interleaved else (pool.data, pool.scales)
    if pool.kind == "int8":
        values = data.float()
    else:
        values = torch.stack([data & 0x0F, data >> 4], dim=-1).flatten(-2).float() - 8.0
    group = values.shape[-1] // scales.shape[-1]
    w = values * scales.float().repeat_interleave(group, dim=-1)
    return w[..., : pool.in_features].contiguous()


# ---- interleaved int8 ----------------------------------------------------------------------------------------------

BLOCK_ROWS = 16  # rows of one interleaved block (csrc/gather_linear.cpp kBlockRows)


def interleaves(kind: str, rows: int) -> bool:
    """Whether a CPU pool of `kind` with `rows` output rows holds them interleaved: int8 in whole blocks."""
    return kind == "int8" and rows > 0 and rows % BLOCK_ROWS == 0


def interleaved_shape(rows: int, cols: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The interleaved shape of a row-major part [rows, cols]: int8 codes or float16 scales."""
    if dtype == torch.int8:
        return rows // BLOCK_ROWS, cols // 4, 4 * BLOCK_ROWS
    return rows // BLOCK_ROWS, cols, BLOCK_ROWS


def _words(t: torch.Tensor) -> torch.Tensor:
    """Codes as int32 words (4 columns each), scales as they are: the units interleaving moves."""
    return t.view(torch.int32) if t.dtype == torch.int8 else t


def interleave_into(out: torch.Tensor, rows: torch.Tensor) -> None:
    """A row-major part (int8 codes [..., O, C] or float16 scales [..., O, G]) into `out`'s interleaved layout
    ([..., O / 16, C / 4, 64] or [..., O / 16, G, 16]), which must be contiguous."""
    src = _words(rows.contiguous())
    src = src.view(*src.shape[:-2], -1, BLOCK_ROWS, src.shape[-1])  # [..., B, 16, W]
    _words(out).view(*src.shape[:-2], src.shape[-1], BLOCK_ROWS).copy_(src.transpose(-1, -2))


def interleave(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major int8 (data [..., O, C], scales [..., O, G]) -> its interleaved data and scales (new tensors)."""
    out = []
    for t in (data, scales):
        o = t.new_empty(*t.shape[:-2], *interleaved_shape(t.shape[-2], t.shape[-1], t.dtype))
        interleave_into(o, t)
        out.append(o)
    return out[0], out[1]


def rows_major(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved int8 (data [..., O / 16, C / 4, 64], scales [..., O / 16, G, 16]) -> row-major data [..., O, C]
    and scales [..., O, G] (new tensors)."""
    words = _words(data.contiguous())  # [..., B, C / 4, 16]
    codes = words.transpose(-1, -2).reshape(*words.shape[:-3], -1, words.shape[-2]).contiguous().view(torch.int8)
    s = scales.transpose(-1, -2).reshape(*scales.shape[:-3], -1, scales.shape[-2]).contiguous()
    return codes, s


def interleaved_pool(pool: Pool) -> Pool:
    """An int8 pool interleaved where `interleaves` says (other pools as they are)."""
    if pool.interleaved or not interleaves(pool.kind, pool.out_features):
        return pool
    assert pool.scales is not None
    data, scales = interleave(pool.data, pool.scales)
    return Pool(pool.kind, data, scales, pool.in_features)
