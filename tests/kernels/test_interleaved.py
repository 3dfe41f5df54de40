"""Interleaved int8 pools (kernels/pool.py): the layout round-trips, the products match the float64 reference on
both implementations, and a pair's bits do not depend on the call, with more pairs of one slot than a tile holds."""

from __future__ import annotations

import pytest
import torch

from moelane import kernels
from moelane.kernels import pool as pools
from tests.kernels.helpers import random_pool, reference

# In: int8 groups of 64 (192, 2048), 32 (96), 16 (48), 64 padded (100); Out: whole blocks of 16
SIZES = [(192, 16), (96, 48), (48, 32), (100, 16), (2048, 32)]


def test_the_layout_holds_the_row_major_codes() -> None:
    """Byte 4l + t of [s, b, j] is row 16b + l's code at column 4j + t; scale [s, b, g, l] row 16b + l's of group g;
    `rows_major` inverts it; both dequantise to the same weights."""
    rows = random_pool("int8", 2, 48, 100, seed=3)
    inter = pools.interleaved_pool(rows)
    assert inter.interleaved and inter.out_features == 48 and inter.group == rows.group and inter.cols == rows.cols
    assert inter.data.shape == (2, 3, rows.cols // 4, 64) and inter.scales.shape == (2, 3, rows.scales.shape[2], 16)
    assert inter.nbytes == rows.nbytes
    for s, b, j, lane, t in ((0, 0, 0, 0, 0), (1, 2, 5, 7, 3), (1, 1, rows.cols // 4 - 1, 15, 2)):
        assert inter.data[s, b, j, 4 * lane + t] == rows.data[s, 16 * b + lane, 4 * j + t]
    assert inter.scales[1, 2, 1, 9] == rows.scales[1, 41, 1]
    data, scales = pools.rows_major(inter.data, inter.scales)
    assert torch.equal(data, rows.data) and torch.equal(scales, rows.scales)
    assert torch.equal(kernels.dequantize(inter), kernels.dequantize(rows))
    assert pools.interleaved_pool(random_pool("int8", 1, 9, 64, seed=1)).data.dim() == 3  # not whole blocks
    assert pools.interleaved_pool(random_pool("int4", 1, 16, 64, seed=1)).kind == "int4"


def test_bad_interleaved_pools_are_refused() -> None:
    inter = pools.interleaved_pool(random_pool("int8", 2, 32, 64, seed=1))
    assert inter.scales is not None
    with pytest.raises(ValueError, match="scales"):
        kernels.Pool("int8", inter.data, inter.scales.transpose(2, 3).contiguous(), 64)
    with pytest.raises(ValueError, match="padded"):
        kernels.Pool("int8", inter.data, inter.scales, 200)


@pytest.mark.parametrize(("n_in", "n_out"), SIZES)
def test_matches_float64_reference(impl: str, n_in: int, n_out: int) -> None:
    pool = random_pool("int8-interleaved", 3, n_out, n_in, seed=n_in + n_out)
    x = torch.randn(4, n_in, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    rows, slots = torch.randint(0, 4, (19,), generator=g), torch.randint(0, 3, (19,), generator=g)
    y = kernels.gather_linear(x, rows, slots, pool)
    want, bound = reference(x, rows, slots, pool)
    assert y.shape == (19, n_out)
    assert torch.all((y.double() - want).abs() <= bound), (y.double() - want).abs().max()
    assert torch.equal(kernels.linear(x, pools.Pool("int8", pool.data[:1], pool.scales[:1], n_in)),  # type: ignore[index]
                       kernels.gather_linear(x, torch.arange(4), torch.zeros(4, dtype=torch.long), pool))  # fmt: skip


@pytest.mark.parametrize("n_in", [192, 96, 48])
def test_pair_bits_do_not_depend_on_the_call(extension: kernels.Availability, n_in: int, threads: None) -> None:
    """Pair (row 3, slot 2) alone, then among 2..20 pairs (of other slots, or all of its own slot: up to 20 rows a
    slot, more than one tile's 8), at 2 and 1 threads: the same bits."""
    pool = random_pool("int8-interleaved", 5, 64, n_in, seed=5)
    x = torch.randn(24, n_in, generator=torch.Generator().manual_seed(6))
    torch.set_num_threads(2)
    alone = kernels.gather_linear(x[3:4], torch.tensor([0]), torch.tensor([2]), pool)[0]
    for n_threads in (2, 1):
        torch.set_num_threads(n_threads)
        for n in (2, 5, 8, 9, 16, 20):
            g = torch.Generator().manual_seed(n)
            rows, slots = torch.randint(0, 24, (n,), generator=g), torch.randint(0, 5, (n,), generator=g)
            at = n // 2
            rows[at], slots[at] = 3, 2
            assert torch.equal(kernels.gather_linear(x, rows, slots, pool)[at], alone), (n_threads, n)
            same = kernels.gather_linear(x, rows, torch.full_like(slots, 2), pool)
            assert torch.equal(same[at], alone), (n_threads, n, "one slot")
