"""The quantised weight formats: symmetric, group-wise along each weight row (the input dimension), one float16 scale
per group. int8: groups of 64, codes in [-127, 127]. int4: groups of 32, codes in [-7, 7], two codes per byte (low
nibble first), stored offset by 8. A row whose length is not a multiple of the group uses half or a quarter of it
when that divides the row (at least 16), else is zero-padded to whole groups.

A format carries its group: `FORMATS` are the tiers' own, and a GGUF's Q8_0 experts are held as `QuantFormat(8, 32)`,
Q4_0's as int4's format, with the file's codes (docs/gguf.md). Those may be -128 (int8) or -8 (int4, nibble 0), which
`quantize` never writes; `dequantize` and the kernels decode every code the same way (code * scale, (nibble - 8) *
scale).

These are the pager's precision tiers 1 and 2 (`moelane.pager.live.tiers`) and the formats `gather_linear` computes
from (`pool.py`); they live here, below both, so the kernels need nothing from the pager.
"""

from __future__ import annotations

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

    @property
    def qmax(self) -> int:
        return 127 if self.bits == 8 else 7

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


def quantize(w: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] float -> (codes uint8 [R * padded * bits / 8], scales float16 [R, G])."""
    rows, cols = w.shape
    n_groups, group = fmt.n_groups(cols), fmt.group_for(cols)
    wf = torch.nn.functional.pad(w.float(), (0, n_groups * group - cols)).view(rows, n_groups, group)
    amax = wf.abs().amax(dim=-1)
    scales = (amax / fmt.qmax).clamp(max=65504.0).to(torch.float16)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # all-zero groups (or underflow) code as 0
    codes = torch.round(wf / scales.float()[..., None]).clamp(-fmt.qmax, fmt.qmax).to(torch.int16)
    if fmt.bits == 8:
        return codes.to(torch.int8).view(torch.uint8).reshape(-1), scales
    nibbles = (codes + 8).to(torch.uint8).reshape(-1, 2)
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scales


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
