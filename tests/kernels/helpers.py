"""Random pools and the float64 reference every kernel test compares with."""

from __future__ import annotations

import torch

from moelane import kernels


def random_pool(kind: str, n_slots: int, n_out: int, n_in: int, seed: int) -> kernels.Pool:
    """S random matrices [Out, In] (one all-zero half row: a zero group) quantised to `kind`."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_slots, n_out, n_in, generator=g) * 0.05
    w[0, 0, : n_in // 2] = 0.0
    return kernels.quantize(w, kind)


def reference(
    x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, pool: kernels.Pool
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y in float64 from the dequantised weights, the error bound) [P, Out].

    Bound: (In / 16 + 6) * 2^-24 * sum_i |x_i w_i|, the first-order bound of a sum of In products with at most
    In / 16 + 6 roundings on any term's path: the extension rounds each FMA of its 16-lane chain (In / 16) and 4
    levels of tree; the fallback rounds the product, its 64-lane chain (In / 64) and 6 levels of halving."""
    w = kernels.dequantize(pool).double()[slots]
    xs = x.double()[rows]
    y = torch.einsum("pi,poi->po", xs, w)
    magnitude = torch.einsum("pi,poi->po", xs.abs(), w.abs())
    return y, (x.shape[1] / 16 + 6) * 2.0**-24 * magnitude
