"""`gather_linear` on a CUDA device: one Triton kernel for every pool kind (f32, bf16, int8, int4).

    y[p] = x[rows[p]] @ W[slots[p]].T      (moelane.kernels' op; the same semantics and shapes as on the CPU)

Imported only when a product runs on a CUDA tensor (op.py's "cuda" implementation), so a CPU run never imports
Triton. Under `TRITON_INTERPRET=1` the kernel also runs on CPU tensors, which is how the tests check it on machines
without a GPU (tests/kernels/test_cuda_kernel.py).

Batch invariance (docs/batch-invariance.md, "On a device"): one program computes BLOCK_OUT output rows of ONE pair,
whole: it walks the pair's input row in chunks of BLOCK_IN columns, in order, adding each chunk's products
element-wise into a [BLOCK_OUT, BLOCK_IN] fp32 accumulator, then sums each accumulator row by Triton's fixed tree.
The block sizes are constants of the kernel, never chosen by the number of pairs or rows, so y[p] is the same bits
whatever P is and whichever pairs share the launch: no matrix unit, no split reduction, no autotuning. Each weight
is widened to its exact fp32 value (bf16; code * fp16 scale; (nibble - 8) * scale) before the multiply, as the CPU
does for f32 and bf16, so those agree with the CPU kernels to fp32 rounding (not bitwise: another summation order);
the CPU's int8 and int4 code their activations to int8 first (docs/kernels.md), this kernel does not.

Bytes: each pair reads its slot's bytes; pairs of one slot in one launch read them again from the L2 cache (50 MB on
an H100), not from device memory, at decode's few rows a slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelane.kernels.pool import rows_major

BLOCK_OUT = 32  # output rows a program computes
BLOCK_IN = 64  # input columns a chunk: a multiple of every quantised group (16, 32, 64)
KIND_IDS = {torch.float32: 0, torch.bfloat16: 0, torch.int8: 1, torch.uint8: 2}  # float, int8, int4


# (no annotations but constexpr: Triton resolves each annotation as a name of this module)
@triton.jit  # type: ignore[untyped-decorator]
def _gather_linear_kernel(  # type: ignore[no-untyped-def]
    x_ptr, rows_ptr, slots_ptr, data_ptr, scales_ptr, y_ptr,
    n_in, n_out, x_stride, data_slot_stride, data_row_stride, scale_slot_stride, scale_row_stride,
    KIND: tl.constexpr, GROUP: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_SLOTS: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    out0 = tl.program_id(1) * BLOCK_O
    row = tl.load(rows_ptr + pair) if HAS_ROWS else pair
    slot = tl.load(slots_ptr + pair) if HAS_SLOTS else pair * 0
    outs = out0 + tl.arange(0, BLOCK_O)
    out_ok = outs < n_out
    x_row = x_ptr + row.to(tl.int64) * x_stride
    w_rows = data_ptr + slot.to(tl.int64) * data_slot_stride + outs.to(tl.int64)[:, None] * data_row_stride
    s_rows = scales_ptr + slot.to(tl.int64) * scale_slot_stride + outs.to(tl.int64)[:, None] * scale_row_stride
    if KIND == 2:  # int4: byte j holds column 2j (low nibble) and 2j + 1 (high); even and odd columns apart
        acc_lo = tl.zeros((BLOCK_O, BLOCK_K // 2), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_O, BLOCK_K // 2), dtype=tl.float32)
        for k0 in tl.range(0, n_in, BLOCK_K):
            cols = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # even columns
            lo_ok, hi_ok = cols < n_in, cols + 1 < n_in
            x_lo = tl.load(x_row + cols, mask=lo_ok, other=0.0)
            x_hi = tl.load(x_row + cols + 1, mask=hi_ok, other=0.0)
            b = tl.load(w_rows + (cols // 2)[None, :], mask=out_ok[:, None] & lo_ok[None, :], other=0x88)
            s = tl.load(s_rows + (cols // GROUP)[None, :], mask=out_ok[:, None] & lo_ok[None, :], other=0.0)
            s = s.to(tl.float32)
            w_lo = ((b & 0x0F).to(tl.float32) - 8.0) * s
            w_hi = ((b >> 4).to(tl.float32) - 8.0) * s
            acc_lo += w_lo * x_lo[None, :]
            acc_hi += w_hi * x_hi[None, :]
        y = tl.sum(acc_lo + acc_hi, axis=1)
    else:
        acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, n_in, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            ok = cols < n_in
            xk = tl.load(x_row + cols, mask=ok, other=0.0)
            w = tl.load(w_rows + cols[None, :], mask=out_ok[:, None] & ok[None, :], other=0).to(tl.float32)
            if KIND == 1:  # int8: code * its group's scale
                s = tl.load(s_rows + (cols // GROUP)[None, :], mask=out_ok[:, None] & ok[None, :], other=0.0)
                w = w * s.to(tl.float32)
            acc += w * xk[None, :]
        y = tl.sum(acc, axis=1)
    tl.store(y_ptr + pair.to(tl.int64) * n_out + outs, y, mask=out_ok)


def gather_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    slots: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """x [R, In] f32, rows / slots [P] int64 (None: arange(R) / all slot 0), data / scales a pool's -> y [P, Out]
    f32. No host synchronisation: indices are trusted in range (the callers' `kernels.gather_linear` checks shapes;
    the CPU implementations check values)."""
    if data.dim() == 4 and scales is not None:  # interleaved int8 (the CPU's layout, pool.py): row-major here
        data, scales = rows_major(data, scales)
    if x.dtype != torch.float32 or x.dim() != 2 or data.dim() != 3 or data.dtype not in KIND_IDS:
        raise RuntimeError("gather_linear: x must be float32 [R, In] and data a pool's [S, Out, In]")
    x = x.contiguous()
    n_pairs = x.shape[0] if rows is None else rows.shape[0]
    n_out = data.shape[1]
    kind = KIND_IDS[data.dtype]
    y = torch.empty((n_pairs, n_out), dtype=torch.float32, device=x.device)
    if n_pairs == 0 or n_out == 0:
        return y
    if kind:
        assert scales is not None
        stored = data.shape[2] * (2 if kind == 2 else 1)
        group = stored // scales.shape[2]
        s_strides = (scales.stride(0), scales.stride(1))
    else:
        scales, group, s_strides = data, 1, (0, 0)  # (unread)
    grid = (n_pairs, triton.cdiv(n_out, BLOCK_OUT))
    _gather_linear_kernel[grid](
        x, x if rows is None else rows, x if slots is None else slots, data, scales, y,
        x.shape[1], n_out, x.stride(0), data.stride(0), data.stride(1), s_strides[0], s_strides[1],
        KIND=kind, GROUP=group, HAS_ROWS=rows is not None, HAS_SLOTS=slots is not None,
        BLOCK_O=BLOCK_OUT, BLOCK_K=BLOCK_IN,
    )  # fmt: skip
    return y
