"""A GGUF's Q8_0 and Q4_0 experts and dense projections as moelane's int8 / int4 codes and scales, moved, never
requantised (docs/gguf.md#experts).

    Q8_0  block of 32 values: fp16 d, 32 int8 codes q;               value = q * d
          -> int8 in groups of 32 (`QuantFormat(8, 32)`): the codes as they are, d the group's scale
    Q4_0  block of 32 values: fp16 d, 16 bytes, byte j = n_j | n_(j+16) << 4;   value = (n - 8) * d
          -> int4 in groups of 32 (tier 2's format): byte j = n_2j | n_(2j+1) << 4, the nibbles unchanged

So every weight a pool holds is exactly the value the `gguf` package decodes from the block (code * fp16 scale is
exact in fp32), including Q8_0's code -128, which moelane's own quantiser never writes.
Block sizes come from `gguf.GGML_QUANT_SIZES`. The repacking is numpy (single-threaded): the store's I/O threads run
it, and a torch op there would start an OpenMP team of their own (`pager.live.tiers.row_blocks`). A dense
projection's blocks become a one-slot kernels `Pool` the same way (`matrix_pool`), as `--quantize auto` holds them.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

from moelane.kernels.formats import FORMATS, QuantFormat
from moelane.kernels.pool import Pool
from moelane.model.checkpoint import ExpertHandle
from moelane.model.provider import TIER_KINDS

# By GGML type: the precision tier whose pool takes the blocks' codes as they are, and that pool's format
CODE_TIERS: dict[str, tuple[int, QuantFormat]] = {"Q8_0": (1, QuantFormat(8, 32)), "Q4_0": (2, FORMATS[2])}


def codes_tier(handles: dict[int, list[ExpertHandle]]) -> tuple[int, QuantFormat] | None:
    """The tier (and its format) holding these experts as their own codes: every expert tensor Q8_0 (tier 1, int8)
    or every one Q4_0 (tier 2, int4), in a GGUF's expert layouts; else None."""
    kinds = {ref.dtype for hs in handles.values() for h in hs for ref in h.tensors.values()}
    layouts = {h.layout for hs in handles.values() for h in hs}
    if len(kinds) != 1 or not layouts <= {"gguf", "gguf_pairs"}:
        return None
    return CODE_TIERS.get(kinds.pop())


def block_codes(blocks: np.ndarray, kind: str, codes: np.ndarray, scales: np.ndarray) -> None:
    """One matrix's blocks (uint8 [R, B * type_size], `kind` Q8_0 or Q4_0) -> `codes` (int8 [R, B * 32] or uint8
    [R, B * 16]) and `scales` (float16 [R, B]), written in place."""
    block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, size)  # [R, B, type_size]
    scales[...] = b[..., :2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        codes[...] = b[..., 2:].view(np.int8).reshape(rows, -1)
        return
    packed = b[..., 2:]  # [R, B, 16]: value j's nibble low, value j + 16's high
    nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1, block // 2, 2)
    codes[...] = (nibbles[..., 0] | (nibbles[..., 1] << 4)).reshape(rows, -1)


def matrix_pool(blocks: torch.Tensor, kind: str) -> Pool:
    """One matrix's blocks (uint8 [R, B * type_size], `kind` Q8_0 or Q4_0) -> a one-slot kernels pool of its codes
    and scales (int8 / int4 in groups of 32), as the experts' pools hold them."""
    fmt = CODE_TIERS[kind][1]
    block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rows, cols = blocks.shape[0], blocks.shape[1] // size * block
    codes = np.empty((rows, cols * fmt.bits // 8), np.int8 if fmt.bits == 8 else np.uint8)
    scales = np.empty((rows, cols // block), np.float16)
    block_codes(blocks.numpy(), kind, codes, scales)
    return Pool(TIER_KINDS[CODE_TIERS[kind][0]], torch.from_numpy(codes)[None], torch.from_numpy(scales)[None], cols)


def expert_codes_into(handle: ExpertHandle, stored: dict[str, torch.Tensor], parts: tuple[torch.Tensor, ...]) -> None:
    """One expert's blocks as read (`stored`: its tensors' bytes by name, uint8 [rows, bytes]) -> its pool slot's
    parts (codes13 [2I, .], scales13 [2I, G], codes2 [H, .], scales2 [H, G2]). w13 rows as the decoded expert's:
    gate then up (a fused gate_up as it is), or interleaved for "gguf_pairs" (`checkpoint.gguf_expert`)."""
    codes13, scales13, codes2, scales2 = (p.numpy() for p in parts)
    kind = handle.tensors["down"].dtype
    block_codes(stored["down"].numpy(), kind, codes2, scales2)
    if handle.layout == "gguf" and "gate_up" in stored:
        block_codes(stored["gate_up"].numpy(), kind, codes13, scales13)
        return
    if "gate_up" in stored:
        gate, up = np.split(stored["gate_up"].numpy(), 2)
    else:
        gate, up = stored["gate"].numpy(), stored["up"].numpy()
    width = gate.shape[0]
    if handle.layout == "gguf_pairs":  # rows 2i (gate i) and 2i + 1 (up i)
        block_codes(gate, kind, codes13[0::2], scales13[0::2])
        block_codes(up, kind, codes13[1::2], scales13[1::2])
    else:
        block_codes(gate, kind, codes13[:width], scales13[:width])
        block_codes(up, kind, codes13[width:], scales13[width:])
