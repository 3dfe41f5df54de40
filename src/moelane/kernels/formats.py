"""The quantised weight formats: symmetric, group-wise along each weight row (the input dimension), one float16 scale
per group. int8: groups of 64, codes in [-127, 127]. int4: groups of 32, codes in [-8, 7], two codes per byte (low
nibble first), stored offset by 8, each group's scale the one of a few candidates that codes it with the least
squared error (`_int4_codes`). A row whose length is not a multiple of the group uses half or a quarter of it
when that divides the row (at least 16), else is zero-padded to whole groups.

A format carries its group: `FORMATS` are the tiers' own, and a GGUF's Q8_0 experts are held as `QuantFormat(8, 32)`,
Q4_0's as int4's format, with the file's codes (docs/gguf.md). Those may be -128 (int8), which `quantize` never
writes; `dequantize` and the kernels decode every code the same way (code * scale, (nibble - 8) * scale), and a
scale may be negative (Q4_0's, and int4's when its group's extreme is negative).

These are the pager's precision tiers 1 and 2 (`moelane.pager.live.tiers`) and the formats `gather_linear` computes
from (`pool.py`); they live here, below both, so the kernels need nothing from the pager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """Codes per weight and group size of one quantised tier."""

    bits: int
    group: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group < 2 or self.group % 2:
            raise ValueError(f"group must be an even number >= 2, got {self.group}")

    def group_for(self, cols: int) -> int:
        """The group used for rows of `cols` weights: `group`, or half or a quarter of it if that divides the row."""
        for g in (self.group, self.group // 2, self.group // 4):
            if g >= 16 and g % 2 == 0 and cols % g == 0:
                return g
        return self.group

    def n_groups(self, cols: int) -> int:
        return -(-cols // self.group_for(cols))

    def code_bytes(self, rows: int, cols: int) -> int:
        padded = self.n_groups(cols) * self.group_for(cols)
        return rows * padded * self.bits // 8

    def scale_bytes(self, rows: int, cols: int) -> int:
        return rows * self.n_groups(cols) * 2


FORMATS: dict[int, QuantFormat] = {1: QuantFormat(8, 64), 2: QuantFormat(4, 32)}
# Bump whenever `quantize` gives other codes or scales for the same weights: the files that keep its output record
# it (dense caches: model/derived.py; tier files: beside their layout's TIER_FILE_VERSION, pager/live/storage.py).
QUANTIZER_VERSION = 3


def quantize(w: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (codes uint8 [R * padded * bits / 8], scales float16 [R, G])."""
    rows, cols = w.shape
    n_groups, group = fmt.n_groups(cols), fmt.group_for(cols)
    wf = torch.nn.functional.pad(w.float(), (0, n_groups * group - cols)).view(rows, n_groups, group)
    if fmt.bits == 4:
        codes, scales = _int4_codes(wf.reshape(-1, group))
        nibbles = (codes + 8).to(torch.uint8).reshape(-1, 2)
        return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scales.view(rows, n_groups)
    amax = wf.abs().amax(dim=-1)
    scales = (amax / 127).clamp(max=65504.0).to(torch.float16)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # all-zero groups (or underflow) code as 0
    codes = torch.round(wf / scales.float()[..., None]).clamp(-127, 127).to(torch.int16)
    return codes.to(torch.int8).view(torch.uint8).reshape(-1), scales


# int4 scales tried per group, as the group's signed extreme m over each divisor: m / -8 codes m as -8 (llama.cpp's
# Q4_0), m / 7 as +7 (a symmetric [-7, 7] code); the others trade clipping the extreme for a finer step.
# Seven divisors: on normal weights their squared error is within 1% of fourteen's (-8.5 to 7.5 by 0.25), at half
# the time (30% under [-7, 7]'s symmetric code and 10% under Q4_0's).
INT4_DIVISORS = (-8.5, -8.0, -7.5, -7.0, -6.5, 7.0, 7.5)
_INT4_CHUNK = 1 << 16  # groups searched at once (a few MB of float32 per candidate)


def _int4_codes(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [N, G] float32 -> (codes int16 [N, G] in [-8, 7], scales float16 [N]): per group, of every divisor's
    scale and the least-squares scale for that scale's codes (both rounded to float16), the one whose codes
    reconstruct the group with the least squared error. So no group is coded worse than Q4_0's rule (divisor -8) or a
    symmetric [-7, 7] code (divisor 7) would code it."""
    codes = torch.empty(groups.shape, dtype=torch.int16)
    scales = torch.empty(groups.shape[0], dtype=torch.float16)
    for start in range(0, groups.shape[0], _INT4_CHUNK):
        w = groups[start : start + _INT4_CHUNK]
        extreme = w.gather(1, w.abs().argmax(dim=1, keepdim=True)).squeeze(1)
        best_err = torch.full_like(extreme, math.inf)
        best_codes, best_scale = torch.zeros_like(w), torch.ones_like(extreme)
        for divisor in INT4_DIVISORS:
            scale = _fp16(extreme / divisor)
            c = torch.round(w / scale[:, None]).clamp_(-8, 7)
            fitted = _fp16((w * c).sum(1) / (c * c).sum(1))  # 0 / 0 in an all-zero group: nan, refused below
            for s in (scale, fitted):
                err = (w - c * s[:, None]).square_().sum(1)
                better = err < best_err  # nan (a nan scale) never is
                best_err = torch.where(better, err, best_err)
                best_scale = torch.where(better, s, best_scale)
                best_codes = torch.where(better[:, None], c, best_codes)
        codes[start : start + _INT4_CHUNK] = best_codes.to(torch.int16)
        scales[start : start + _INT4_CHUNK] = best_scale.to(torch.float16)
    return codes, scales


def _fp16(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float16 will hold them (in range), back in float32; 0 (an all-zero group, or underflow) as 1."""
    scale = scale.clamp(-65504.0, 65504.0).to(torch.float16).float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, cols: int, fmt: QuantFormat) -> torch.Tensor:
    """Inverse of `quantize`: -> float32 [R, cols]."""
    rows, n_groups = scales.shape
    if fmt.bits == 8:
        values = codes.view(torch.int8).float()
    else:
        values = torch.stack([(codes & 0x0F), (codes >> 4)], dim=-1).reshape(-1).float() - 8.0
    group = fmt.group_for(cols)
    w = values.view(rows, n_groups, group) * scales.float()[..., None]
    return w.reshape(rows, n_groups * group)[:, :cols]


# Activations meeting int8 and int4 weights are coded per block of ACTIVATION_BLOCK columns, as llama.cpp's Q8_0
# codes them (docs/kernels.md "int8 and int4: integer dot products"); rows are padded with zeros to whole
# ACTIVATION_CHUNKs (the CPU's int8 chunks; its int4 chunks of 128 hold the same codes in another order).
ACTIVATION_BLOCK = 32
ACTIVATION_CHUNK = 64


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, I] float32 -> (codes int8 [R, C], scales float32 [R, C / 32]), C = I padded to 64: per block of 32
    columns d = max |x| / 127 and code = round-half-even(x * (1 / d)) in [-127, 127], 0 where d is below the
    smallest normal float. The CPU kernel's rule bit for bit on finite rows (csrc/activations.h); a block holding a
    NaN or an infinity gets a non-finite d, so its products come out NaN."""
    cols = -(-x.shape[1] // ACTIVATION_CHUNK) * ACTIVATION_CHUNK
    blocks = torch.nn.functional.pad(x.float(), (0, cols - x.shape[1])).view(x.shape[0], -1, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # tensor / tensor: a true fp32 division, as the kernel's (a Python scalar divisor may become a reciprocal multiply)
    scales = amax / torch.full_like(amax, 127.0)
    usable = (scales >= torch.finfo(torch.float32).tiny) & torch.isfinite(scales)  # normal: 1 / d is finite
    inverse = torch.where(usable, torch.ones_like(scales) / torch.where(usable, scales, 1.0), 0.0)
    codes = torch.round(blocks * inverse[..., None]).clamp(-127, 127).nan_to_num(0.0)
    return codes.to(torch.int8).view(x.shape[0], cols), scales
