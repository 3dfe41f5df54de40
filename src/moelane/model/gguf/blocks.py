"""GGUF tensor types as moelane stores them: float types as their own dtypes, block-quantised types as raw bytes.

A block-quantised tensor (Q8_0, Q4_0, the K-quants, ...) of logical shape [..., C] is held as uint8 [..., R]: each row
of C values is C / block_size blocks of type_size bytes, exactly the file's bytes (`gguf.GGML_QUANT_SIZES`). Its
`TensorRef.dtype` is the GGML type's name ("Q8_0"), so a reader knows the bytes are blocks and of which kind; its
`TensorRef.shape` is the byte shape, so the stored form can be viewed and copied like any other tensor. Values come out
only through `dequantize`, the `gguf` package's own decoder of each type (docs/gguf.md#tensor-types).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType

# The float types read as they are, and the block types `gguf.quants.dequantize` decodes (NVFP4 needs a second
# per-tensor scale that lives in another tensor, so it is left out).
FLOAT_TYPES = ("F32", "F16", "BF16")
BLOCK_TYPES = (
    *("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    *("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"),
    *("TQ1_0", "TQ2_0", "MXFP4"),
)


# The quantised tier nearest each block type, which `--default-tier auto` requantises experts of that type to, once
# (docs/gguf.md, "K-quant and other experts"): int4 (tier 2) for codes of at most 4 bits, int8 (tier 1) for 5 to 8.
# MXFP4 has none (its 4-bit floats are not evenly spaced: int4 would round 0.5 in 6 to 6/7), nor have float types.
NEAREST_TIER: dict[str, int] = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"), 2),
    **dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"), 2),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K"), 1),
}


def is_block_type(dtype: str) -> bool:
    return dtype in BLOCK_TYPES


def byte_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The stored shape of a tensor of logical `shape` (numpy order, rows last) in `dtype`."""
    if not is_block_type(dtype):
        return shape
    return tuple(gguf.quant_shape_to_byte_shape(shape, GGMLQuantizationType[dtype]))


def logical_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The shape of the values a stored tensor of `shape` in `dtype` holds."""
    if not is_block_type(dtype):
        return shape
    return tuple(gguf.quant_shape_from_byte_shape(shape, GGMLQuantizationType[dtype]))


def dequantize(stored: torch.Tensor, dtype: str) -> torch.Tensor:
    """Blocks of GGML type `dtype` (uint8 [..., R]) -> their values in float32 [..., C], decoded by the `gguf`
    package (each block's scale times its codes, computed in float32 as ggml's reference decoders do)."""
    values = gguf.quants.dequantize(np.ascontiguousarray(stored.numpy()), GGMLQuantizationType[dtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
