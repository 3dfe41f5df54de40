"""`gather_linear` in plain PyTorch, for where the C++ extension cannot be built. Slow, same semantics: int8 and int4
weights meet the activations' int8 codes (`formats.quantize_activations`), each product the exact code product times
the activation scale x the weight scale.

Batch invariance here: a pair's y comes from element-wise ops only (no matmul, no torch reduction, whose order
can depend on shapes and threads): its x row and each dequantised weight row are cut into chunks of LANES columns,
accumulated chunk by chunk into LANES partial sums (a multiply then an add, in column order), then summed by halving
(lanes l and l + n/2, n = LANES, LANES/2, ... 1). Which other pairs share the call only changes how many such rows go
through each op together, never the arithmetic of one. Not the extension's bits (it fuses multiply-adds and uses 16
lanes), but the same kind of bound against a float64 reference.

Shape alphabet: R activation rows, I input columns, S slots, O output rows, P pairs, n pairs of one slot, B a block
of output rows, L lanes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moelane.kernels.formats import quantize_activations
from moelane.kernels.pool import rows_major

LANES = 64
BLOCK_ELEMENTS = 1 << 20  # n * B * L per step


def gather_linear(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    slots: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    """x [R, I] f32, rows / slots [P] int64 (None: arange(R) / all slot 0), data / scales a pool's -> y [P, O]."""
    if data.dim() == 4 and scales is not None:  # interleaved int8 (pool.py): the same codes, row-major
        data, scales = rows_major(data, scales)
    n_pairs = x.shape[0] if rows is None else rows.numel()
    rows = torch.arange(n_pairs) if rows is None else rows
    slots = torch.zeros(n_pairs, dtype=torch.int64) if slots is None else slots
    _check(x, rows, slots, data)
    y = x.new_empty(n_pairs, data.shape[1])
    if n_pairs == 0:
        return y
    order = torch.argsort(slots, stable=True)
    used, counts = torch.unique_consecutive(slots[order], return_counts=True)
    coded = None if scales is None else _int8_activations(x)  # int8 / int4 (the kinds with scales): per column
    for slot, pairs in zip(used.tolist(), torch.split(order, counts.tolist()), strict=True):
        block = max(1, BLOCK_ELEMENTS // (len(pairs) * LANES))
        if coded is None or scales is None:  # f32 / bf16 (scales: for the type checker)
            xs = _pad(x[rows[pairs]].float())  # [n, I']
            for r0 in range(0, data.shape[1], block):
                w = _pad(data[slot, r0 : r0 + block].float())  # [B, I']
                y[pairs, r0 : r0 + w.shape[0]] = _dots(xs, w)
            continue
        x_codes, x_scales = (t[rows[pairs]] for t in coded)  # [n, I']
        for r0 in range(0, data.shape[1], block):
            codes = _codes(data[slot, r0 : r0 + block])  # [B, C]
            w_scales = _pad(_per_column(scales[slot, r0 : r0 + block].float(), codes.shape[1])[:, : x.shape[1]])
            y[pairs, r0 : r0 + codes.shape[0]] = _dots(x_codes, _pad(codes[:, : x.shape[1]]), x_scales, w_scales)
    return y


def _int8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, I] -> (codes, scales) per column, float32 [R, I'] (I' = I padded to LANES)."""
    codes, scales = quantize_activations(x)
    per_column = _per_column(scales, codes.shape[1])
    return _pad(codes.float()[:, : x.shape[1]]), _pad(per_column[:, : x.shape[1]])


def _per_column(s: torch.Tensor, cols: int) -> torch.Tensor:
    """Group scales [B, G] -> each column's scale [B, cols]."""
    return s.repeat_interleave(cols // s.shape[1], dim=1)


def _check(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, data: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 2:
        raise RuntimeError("gather_linear: x must be float32 [R, In]")
    if rows.shape != slots.shape or rows.dim() != 1 or rows.dtype != torch.int64 or slots.dtype != torch.int64:
        raise RuntimeError("gather_linear: rows and slots must be int64 [P]")
    for name, index, bound in (("rows", rows, x.shape[0]), ("slots", slots, data.shape[0])):
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= bound):
            raise RuntimeError(f"gather_linear: {name} index out of range")


def _pad(t: torch.Tensor) -> torch.Tensor:
    """[N, I] -> [N, I'] with I' the next multiple of LANES, zeros after column I."""
    return F.pad(t, (0, -t.shape[1] % LANES))


def _codes(rows: torch.Tensor) -> torch.Tensor:
    """Quantised rows [B, bytes] -> their codes as float32 [B, C]: int8 as stored, int4 nibble - 8 (low first)."""
    if rows.dtype == torch.uint8:
        return torch.stack([rows & 0x0F, rows >> 4], dim=-1).flatten(-2).float() - 8.0
    return rows.float()


def _dots(
    xs: torch.Tensor, w: torch.Tensor, x_scales: torch.Tensor | None = None, w_scales: torch.Tensor | None = None
) -> torch.Tensor:
    """xs [n, I'], w [B, I'] -> [n, B]: per (pair, row) LANES partial sums in column order, then halving. With
    scales (int8, int4: xs and w codes, their products exact), each product is weighed by x scale x w scale first."""
    acc = torch.zeros(xs.shape[0], w.shape[0], LANES)
    for c in range(0, xs.shape[1], LANES):
        chunk = slice(c, c + LANES)
        products = xs[:, None, chunk] * w[None, :, chunk]
        if x_scales is not None and w_scales is not None:
            products = products * (x_scales[:, None, chunk] * w_scales[None, :, chunk])
        acc += products
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def attend_cache(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """`op.attend_cache` in plain PyTorch, in fp32, one row at a time (so a row's ops have the same shapes whatever
    the call holds): q [N, Hq, D], pools [S, Hkv, C, D/Dv], slots [N], mask [N, L], sinks [Hq] -> [N, Hq, Dv]."""
    n, n_heads, _ = q.shape
    n_kv, length = k_pool.shape[1], mask.shape[1]
    group = n_heads // n_kv
    out = q.new_empty((n, n_heads, v_pool.shape[3]), dtype=v_pool.dtype)
    for i in range(n):
        seen = mask[i].nonzero().squeeze(1)
        keys = k_pool[slots[i], :, :length][:, seen].float()  # [Hkv, l, D]
        values = v_pool[slots[i], :, :length][:, seen].float()
        rows = q[i].float().view(n_kv, group, -1)
        scores = torch.bmm(rows, keys.transpose(1, 2)) * scale  # [Hkv, G, l]
        if sinks is not None:
            scores = torch.cat([sinks.float().view(n_kv, group, 1), scores], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., -seen.shape[0] :] if seen.shape[0] else scores[..., :0]
        out[i] = torch.bmm(probs, values).reshape(n_heads, -1).to(v_pool.dtype)
    return out
