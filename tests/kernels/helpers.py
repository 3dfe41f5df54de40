"""Random pools and the float64 reference every kernel test compares with."""

from __future__ import annotations

import pytest
import torch

from moelane import kernels
from moelane.kernels import formats
from moelane.kernels.pool import interleaved_pool
from moelane.model import layers
from moelane.model.weights import replace

INTEGER_KINDS = ("int8", "int4")  # pools whose products meet the activations' int8 codes


def random_pool(kind: str, n_slots: int, n_out: int, n_in: int, seed: int) -> kernels.Pool:
    """S random matrices [Out, In] (one all-zero half row: a zero group) quantised to `kind`, or to int8 and
    interleaved for "int8-interleaved" (Out a multiple of 16)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_slots, n_out, n_in, generator=g) * 0.05
    w[0, 0, : n_in // 2] = 0.0
    if kind == "int8-interleaved":
        pool = interleaved_pool(kernels.quantize(w, "int8"))
        assert pool.interleaved
        return pool
    return kernels.quantize(w, kind)


def reference(
    x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, pool: kernels.Pool
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y in float64 from the dequantised weights, the error bound) [P, Out]. int8 and int4 weights meet x's int8
    codes (`formats.quantize_activations`), so x is taken as those codes dequantised.

    Bound: (In / 16 + 6) * 2^-24 * sum_i |x_i w_i|, the first-order bound of a sum of In products with at most
    In / 16 + 6 roundings on any term's path: the extension rounds each FMA of its 16-lane chain (In / 16) and 4
    levels of tree; the fallback rounds the product, its 64-lane chain (In / 64) and 6 levels of halving. int8 has
    fewer: the scale product, its chain of In / 64 FMAs and the tree (the fallback: one rounding more a product)."""
    w = kernels.dequantize(pool).double()[slots]
    xs = (dequantized_activations(x) if pool.kind in INTEGER_KINDS else x.double())[rows]
    y = torch.einsum("pi,poi->po", xs, w)
    magnitude = torch.einsum("pi,poi->po", xs.abs(), w.abs())
    return y, (x.shape[1] / 16 + 6) * 2.0**-24 * magnitude


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [R, I] as the int8 / int4 kernels see it: its codes times their block's scale, float64 (exact)."""
    codes, scales = formats.quantize_activations(x)
    values = codes.double() * scales.double().repeat_interleave(formats.ACTIVATION_BLOCK, dim=1)
    return values[:, : x.shape[1]]


def sees_int8_codes(x: torch.Tensor) -> torch.Tensor:
    """x [..., I] as an int8 or int4 product sees it: each row's int8 codes dequantised, rounded to float32."""
    return dequantized_activations(x.reshape(-1, x.shape[-1]).float()).float().view_as(x)


def code_like(reference: torch.nn.Module, quantised: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on each projection of `reference` whose counterpart (same name) in `quantised` is an int8 or int4
    pool sees its input as that product sees it (`sees_int8_codes`); its weight is read as an f32 pool for that."""
    theirs = dict(quantised.named_modules())
    coded: set[int] = set()
    for name, module in reference.named_modules():
        twin = theirs.get(name)
        if not isinstance(module, torch.nn.Linear) or not isinstance(getattr(twin, "weight", None), kernels.Pool):
            continue
        if twin.weight.kind in INTEGER_KINDS:  # type: ignore[union-attr]
            if not isinstance(module.weight, kernels.Pool):
                replace(module, kernels.Pool("f32", module.weight.detach().float().contiguous()[None]))
            coded.add(id(module.weight))
    for module in reference.modules():  # q, k and v joined in one pool (`Attention.fuse_projections`)
        joined = getattr(module, "qkv", None)
        if joined is not None and id(module.q_proj.weight) in coded:
            coded.add(id(joined))
    assert coded, "no int8 or int4 projection to code"

    def kernel_linear(x: torch.Tensor, w: kernels.Pool) -> torch.Tensor:
        return kernels.linear(sees_int8_codes(x) if id(w) in coded else x, w)

    monkeypatch.setattr(layers, "kernel_linear", kernel_linear)
