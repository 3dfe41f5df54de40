"""Experts computed from quantised pools (the reference path of `experts.dispatch_tiers`): each pair's product is the
dequantised expert's in float64 within fp32 rounding, the dequantised values are `tiers.dequantize`'s exactly, a
pair's bits depend on nothing but its row and its slot (pools mixed, other pairs, eager or compiled per-pair
gathers), and a native pool from slot 0 keeps the native paths."""

from __future__ import annotations

import pytest
import torch

from moelane.model.experts import dequantized, dispatch, dispatch_tiers, pair_weights, run_experts
from moelane.model.provider import ResidentProvider, TierPool, native_weights
from moelane.pager.live.tiers import FORMATS, dequantize, quantize, slot_parts
from tests.kernels.helpers import sees_int8_codes

KINDS = {"int8": 1, "int4": 2}


def quantised_pool(w13: torch.Tensor, w2: torch.Tensor, kind: str, first: int = 0) -> TierPool:
    """S experts' float weights -> a pool of `kind` holding `tiers.quantize`'s codes and scales, matrix by matrix."""
    if kind == "native":
        return TierPool(first, "native", (w13, None), (w2, None))
    fmt, parts = FORMATS[KINDS[kind]], []
    shapes = slot_parts(KINDS[kind], w13.shape[2], w2.shape[2], torch.float32)
    for w, (code_shape, _) in ((w13, shapes[:2]), (w2, shapes[2:])):
        pairs = [quantize(w[s], fmt) for s in range(w.shape[0])]
        codes = torch.stack([c for c, _ in pairs]).view(code_shape[0]).view(w.shape[0], *code_shape[1])
        parts.append((codes, torch.stack([s for _, s in pairs])))
    return TierPool(first, kind, parts[0], parts[1])


def dequantised(pool: TierPool, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot's matrices through `tiers.dequantize` (float32)."""
    if pool.kind == "native":
        return pool.w13[0][slot].float(), pool.w2[0][slot].float()
    fmt, out = FORMATS[KINDS[pool.kind]], []
    for (codes, scales), cols in ((pool.w13, hidden_of(pool)), (pool.w2, width_of(pool))):
        assert scales is not None
        out.append(dequantize(codes[slot].reshape(-1).view(torch.uint8), scales[slot], cols, fmt))
    return out[0], out[1]


def hidden_of(pool: TierPool) -> int:
    return int(pool.w2[0].shape[1])


def width_of(pool: TierPool) -> int:
    return int(pool.w13[0].shape[1]) // 2


def experts(n: int, hidden: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2 * width, hidden, generator=gen) * 0.1, torch.randn(n, hidden, width, generator=gen) * 0.1


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize(("hidden", "width"), [(64, 32), (48, 24), (40, 36)])  # whole groups, smaller ones, padding
def test_dequantised_slots_are_the_tier_values(kind: str, hidden: int, width: int) -> None:
    w13, w2 = experts(5, hidden, width, seed=hidden)
    pool = quantised_pool(w13, w2, kind)
    index = torch.tensor([[3, 0], [4, 3]])
    got13 = dequantized(kind, pool.w13, index, hidden, torch.float32)
    got2 = dequantized(kind, pool.w2, index, width, torch.float32)
    assert got13.shape == (2, 2, 2 * width, hidden) and got2.shape == (2, 2, hidden, width)
    for t, k in ((0, 0), (0, 1), (1, 0), (1, 1)):
        want13, want2 = dequantised(pool, int(index[t, k]))
        assert torch.equal(got13[t, k], want13) and torch.equal(got2[t, k], want2)
    bf16 = dequantized(kind, pool.w13, index, hidden, torch.bfloat16)
    assert torch.equal(bf16, got13.to(torch.bfloat16))  # one rounding, of the exact fp32 value


def reference(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pools: tuple[TierPool, ...], coded: bool = False
) -> torch.Tensor:
    """Dequantise-then-matmul in float64: sum over k of weights[t, k] * swiglu expert of slot [t, k] on x[t]. With
    `coded`, an int8 or int4 slot's two products see their inputs (x, then its float32 activations) as the kernels'
    integer products do (tests/kernels/helpers.py `sees_int8_codes`)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(slots.shape[0]):
        for k in range(slots.shape[1]):
            slot = int(slots[t, k])
            pool = next(p for p in pools if p.first <= slot < p.first + p.n_slots)
            code = coded and pool.kind in ("int8", "int4")
            w13, w2 = (w.double() for w in dequantised(pool, slot - pool.first))
            gate, up = (w13 @ seen(x[t], code)).chunk(2)
            out[t] += float(weights[t, k]) * (w2 @ seen(torch.nn.functional.silu(gate) * up, code))
    return out


def seen(v: torch.Tensor, code: bool) -> torch.Tensor:
    """A product's input row in float64: as an integer product codes it (from its float32 value), or as it is."""
    return sees_int8_codes(v.float()[None])[0].double() if code else v.double()


def mixed_pools(hidden: int, width: int, seed: int) -> tuple[TierPool, ...]:
    """A native pool of 3 slots from 0, int8 of 4 from 3, int4 of 5 from 7: a store's layout."""
    sizes, pools, first = {"native": 3, "int8": 4, "int4": 5}, [], 0
    for i, (kind, n) in enumerate(sizes.items()):
        pools.append(quantised_pool(*experts(n, hidden, width, seed + i), kind, first))
        first += n
    return tuple(pools)


@pytest.mark.parametrize("kinds", [("int8",), ("int4",), ("native", "int8", "int4")])
def test_the_reference_path_is_dequantise_then_matmul(kinds: tuple[str, ...]) -> None:
    hidden, width, k = 64, 32, 3
    one = (quantised_pool(*experts(6, hidden, width, 1), kinds[0]),)
    pools = mixed_pools(hidden, width, 7) if len(kinds) > 1 else one
    n_slots = sum(p.n_slots for p in pools)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, hidden, generator=gen)
    slots = torch.stack([torch.randperm(n_slots, generator=gen)[:k] for _ in range(9)])
    weights = torch.rand(9, k, generator=gen)
    want = reference(x, slots, weights, pools)
    got = dispatch_tiers(x, slots, weights, pools)
    scale = (want.abs().max() + 1e-6).item()
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale  # fp32 rounding of sums of ~100 products


def test_each_pair_depends_only_on_its_row_and_slot() -> None:
    """A token's output is the same bits alone, among other tokens (other slots, other tiers, the same slots), in the
    eager reference path; the compiled path's per-pair gather gives each pair the same weights as the eager one."""
    hidden, width, k = 48, 24, 3
    pools = mixed_pools(hidden, width, 3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, hidden, generator=gen)
    slots = torch.stack([torch.randperm(12, generator=gen)[:k] for _ in range(20)])
    weights = torch.rand(20, k, generator=gen)
    together = dispatch_tiers(x, slots, weights, pools)
    for t in (0, 7, 19):
        alone = dispatch_tiers(x[t : t + 1], slots[t : t + 1], weights[t : t + 1], pools)
        assert torch.equal(alone[0], together[t])
    w13, w2 = pair_weights(pools, slots, torch.float32, (hidden, width))
    for t, j in ((0, 0), (11, 2), (19, 1)):
        slot = int(slots[t, j])
        pool = next(p for p in pools if p.first <= slot < p.first + p.n_slots)
        want13, want2 = dequantised(pool, slot - pool.first)
        assert torch.equal(w13[t, j], want13) and torch.equal(w2[t, j], want2)


class Pools:
    """A provider of given pools whose `slots` are given too."""

    def __init__(self, pools: tuple[TierPool, ...], slots: torch.Tensor) -> None:
        self._pools, self._slots = pools, slots

    def pools(self, layer: int) -> tuple[TierPool, ...]:
        return self._pools

    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return native_weights(self._pools)

    def slots(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        return self._slots


def test_pairs_all_in_a_native_pool_from_zero_take_the_native_path() -> None:
    """A store's native pool (from slot 0) beside quantised ones: a call whose slots are all native gets the very
    bits of `dispatch` over that pool; one with a quantised slot gets the reference path; `weights` needs one native
    pool from slot 0."""
    hidden, width = 48, 24
    pools = mixed_pools(hidden, width, 11)
    gen = torch.Generator().manual_seed(1)
    x, weights = torch.randn(4, hidden, generator=gen), torch.rand(4, 2, generator=gen)
    native = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]])
    got = run_experts(x, 0, native, weights, Pools(pools, native))
    assert torch.equal(got, dispatch(x, native, weights, pools[0].w13[0], pools[0].w2[0]))
    mixed = native.clone()
    mixed[2, 1] = 9
    got = run_experts(x, 0, mixed, weights, Pools(pools, mixed))
    assert torch.equal(got, dispatch_tiers(x, mixed, weights, pools))
    with pytest.raises(ValueError, match="one native pool from slot 0"):
        Pools(pools, native).weights(0)
    resident = ResidentProvider({0: pools[0]})
    assert torch.equal(resident.weights(0)[0], pools[0].w13[0])


def test_the_reference_path_over_a_native_pool_is_dispatch() -> None:
    """Over a native pool the reference path is `dispatch` exactly: the same grouped products, the same sum."""
    hidden, width = 48, 24
    w13, w2 = experts(6, hidden, width, 4)
    pool = quantised_pool(w13, w2, "native")
    gen = torch.Generator().manual_seed(3)
    x, weights = torch.randn(5, hidden, generator=gen), torch.rand(5, 2, generator=gen)
    slots = torch.tensor([[5, 1], [1, 0], [3, 5], [0, 2], [4, 1]])
    assert torch.equal(dispatch_tiers(x, slots, weights, (pool,)), dispatch(x, slots, weights, w13, w2))
