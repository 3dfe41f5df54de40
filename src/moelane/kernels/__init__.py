"""moelane's CPU weight products: one op, `gather_linear`, that every weight product can go through.

    y[p] = x[rows[p]] @ W[slots[p]].T        x [R, In] f32, rows / slots [P] int64, W a Pool of S [Out, In] -> [P, Out]
    linear(x, pool) = the same with one slot and rows = arange(R)   (dense layers, LM heads)

Decode of a big MoE on a CPU is bound by reading expert weights, so the kernel reads each distinct slot's weights
once per call for all the pairs that use it, dequantising in registers (f32, bf16, int8, int4: pool.py).

Batch invariance, the invariant everything here keeps: y[p] is the same bits whatever P is, whichever other pairs
share the call (other slots, the same slot repeated) and however many threads run. moelane promises replies
token-identical at any batch size, which needs exactly this of every product. Why the kernel has it: each
(pair, output row) dot product is computed whole by one thread, with a fixed chunking, fixed accumulators and a
fixed final tree that depend only on In; rows sharing a slot go through in register blocks of up to 4 whose members
never mix; threads split (slot, output rows) work items, never a dot product (csrc/gather_linear.cpp). The pure
PyTorch fallback keeps it with element-wise ops only (fallback.py). On a CUDA device a Triton kernel serves (cuda.py):
one program per (pair, block of output rows), fixed blocks, no split reduction.

Accuracy: f32 and bf16 weights are widened to their exact fp32 values, so a result is an fp32 dot product of x with
the row, within (In / 16 + 6) * 2^-24 * sum |x_i w_i| of the exact value. int8 and int4 weights meet x coded to int8
per 32 columns (`formats.quantize_activations`, as llama.cpp's Q8_0 and Q4_0 do), in exact integer dot products:
the same bound for x as its codes dequantise it (docs/kernels.md "int8 and int4: integer dot products").
"""

from moelane.kernels.build import BuildError
from moelane.kernels.op import (
    Availability,
    attend_cache,
    attends_in_place,
    available,
    ensure_built,
    gather_linear,
    linear,
    serves,
    use_fallback,
)
from moelane.kernels.pool import FLOAT_KINDS, KINDS, Pool, dequantize, quantize

__all__ = [
    "FLOAT_KINDS",
    "KINDS",
    "Availability",
    "BuildError",
    "Pool",
    "attend_cache",
    "attends_in_place",
    "available",
    "dequantize",
    "ensure_built",
    "gather_linear",
    "linear",
    "quantize",
    "serves",
    "use_fallback",
]
