"""Pools: quantize gives tiers' codes and scales bit for bit, dequantize tiers' values, and bad pools are refused."""

from __future__ import annotations

import pytest
import torch

from moelane import kernels
from moelane.kernels.formats import FORMATS, dequantize, quantize


@pytest.mark.parametrize(("kind", "tier"), [("int8", 1), ("int4", 2)])
@pytest.mark.parametrize("n_in", [192, 96, 36, 100, 24, 48])
def test_quantize_is_tiers_matrix_by_matrix(kind: str, tier: int, n_in: int) -> None:
    w = torch.randn(3, 5, n_in, generator=torch.Generator().manual_seed(n_in)) * 0.05
    w[1, 2] = 0.0
    pool = kernels.quantize(w, kind)
    assert pool.in_features == n_in and pool.n_slots == 3 and pool.out_features == 5
    deq = kernels.dequantize(pool)
    for s in range(3):
        codes, scales = quantize(w[s], FORMATS[tier])
        assert torch.equal(pool.data[s].reshape(-1).view(torch.uint8), codes)
        assert torch.equal(pool.scales[s], scales)
        assert torch.equal(deq[s], dequantize(codes, scales, n_in, FORMATS[tier]))


def test_float_kinds_are_casts() -> None:
    w = torch.randn(2, 3, 17)
    assert torch.equal(kernels.quantize(w, "f32").data, w)
    bf = kernels.quantize(w, "bf16")
    assert bf.data.dtype == torch.bfloat16 and torch.equal(kernels.dequantize(bf), w.bfloat16().float())


def test_bad_pools_are_refused() -> None:
    good = kernels.quantize(torch.randn(2, 3, 64), "int8")
    with pytest.raises(ValueError, match="kind"):
        kernels.Pool("fp8", good.data)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.Pool("f32", torch.randn(2, 3, 64).transpose(1, 2))
    with pytest.raises(ValueError, match="float32"):
        kernels.Pool("f32", good.data)
    with pytest.raises(ValueError, match="in_features"):
        kernels.Pool("int8", good.data, good.scales)
    with pytest.raises(ValueError, match="stored"):
        kernels.Pool("int8", good.data, good.scales, 100)
    with pytest.raises(ValueError, match="scales"):
        kernels.Pool("int8", good.data, good.scales.float(), 64)
    with pytest.raises(ValueError, match="no scales"):
        kernels.Pool("bf16", good.data.bfloat16(), good.scales)
