"""The routed experts' computation: given each token's experts and weights, ask the provider for their pool slots
and compute the weighted sum of the experts' outputs. This is the one place expert kernels live.

The provider never runs an expert: `provider.slots(layer, ids)` makes the routed experts resident and names their pool
slots, `provider.pools(layer)` hands over the pool tensors (one pool per precision tier, provider.py), and the
functions here gather by slot. A provider with `slots_staged` (the pager's store) names the slots before the misses
have loaded; eager dispatch then computes the resident experts first and waits only before the late ones
(`dispatch_staged`), so a miss's read overlaps compute.

Which path runs (`run_experts`): where moelane's C++ kernels serve (every pool has its `kernel` view,
provider.py's `tier_pool`), `kernel_dispatch`: `kernels.gather_linear` reads each used slot's bytes once a call at
its tier (fp32, bf16, int8, int4, tiers mixed), dequantising in registers (docs/kernels.md). Where they cannot be
built: over one native pool from slot 0, the BLAS paths below; otherwise (int8 or int4 slots, or tiers mixed within
one call) `dispatch_tiers`, a reference path in plain torch that dequantises the slots the pairs use.

Eagerly, `run_experts` is `weighted_sum(pair_outputs(...))`: each (token, expert) pair's output in pair order, then
the sum over k in one fixed order. A provider whose experts other processes compute (`moelane.dist`) answers
`pair_outputs` itself, each process running `pair_outputs` here on its share, and the sum stays where it was.

In every dispatch path a row's numbers do not depend on the other rows of the pass (docs/batch-invariance.md):
- eager: sort the pairs by slot, pad each used slot's rows to whole tiles, and compute each slot's group as `linear`
  would (one grouped product over the slots' range, or one product per used slot where they are sparse);
- compiled: each (token, expert) pair's weights gathered by slot inside fixed-order reductions, one kernel for all
  pairs whatever their number, no Python scalar from a tensor, so decode compiles whole;
- tiers: each used slot dequantised on its own, element by element, then the eager or compiled path above;
- kernels: each (pair, output row) dot product computed whole, in an order fixed by the input width alone.

An expert is `down(act(gate_up(x) + b13)) + b2`: `act` is SwiGLU over gate rows then up rows (`swiglu`) unless a
family says otherwise (gpt-oss: a clamped SwiGLU over interleaved rows), and the biases, where a family has them
(gpt-oss), are per expert id, dense tensors of the MoE block: small beside the weights, so not paged. The pairs'
biases (`PairBias`) ride along with the pairs into whichever dispatch path runs. A pair's input `x` is its token's row
[T, H], or one row per pair [T, K, H] where a family scales the input rather than the output (Llama 4).

Shape alphabet: T tokens, K top-k, E experts, S pool slots, U used slots, H hidden, I expert width, P (token, expert)
pairs, Out and In a matrix's rows and columns, G scale groups a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from moelane import kernels
from moelane.kernels.pool import rows_major
from moelane.model.layers import TILE, linear, silu_mul
from moelane.model.provider import ExpertProvider, TierPool

Act = Callable[[torch.Tensor], torch.Tensor]  # gate_up [..., 2I] -> [..., I], batch-invariant


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU over an expert's gate rows then up rows: `silu(gate) * up`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_mul(gate, up)


class PairBias(NamedTuple):
    """The biases of P (token, expert) pairs, in pair order: b13 [P, 2I] after gate_up, b2 [P, H] after down."""

    b13: torch.Tensor
    b2: torch.Tensor

    def take(self, pairs: torch.Tensor) -> PairBias:
        return PairBias(self.b13[pairs], self.b2[pairs])


def pair_bias(bias: tuple[torch.Tensor, torch.Tensor] | None, ids: torch.Tensor) -> PairBias | None:
    """Per-expert biases (b13 [E, 2I], b2 [E, H]) looked up for the pairs of ids [T, K], or None."""
    if bias is None:
        return None
    flat = ids.reshape(-1)
    return PairBias(bias[0][flat], bias[1][flat])


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on rows x [n, H]; w13 [2I, H], w2 [H, I]."""
    return linear(swiglu(linear(x, w13)), w2)


def dispatch(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """Sum over k of weights[t, k] * expert(slots[t, k])(x[t]). x [T, H] (or [T, K, H]: `pair_rows`); slots,
    weights [T, K]."""
    if torch.compiler.is_compiling():
        y = gathered(x, slots, w13, w2, act, bias)
        return weighted_sum(y.reshape(-1, y.shape[-1]), weights)
    rows, rows_of = pair_rows(x, slots.shape[1])
    return weighted_sum(grouped(rows, rows_of, slots.reshape(-1), w13, w2, act, bias), weights)


def pair_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the pairs read, and each pair's row [T * K]: x [T, H], pair t * K + k reads row t; or x [T, K, H],
    each pair its own row."""
    if x.dim() == 3:
        return x.flatten(0, 1), torch.arange(x.shape[0] * k, device=x.device)
    return x, torch.arange(x.shape[0] * k, device=x.device) // k


def gathered(
    x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Act, bias: PairBias | None
) -> torch.Tensor:
    """The compiled path: each (token, expert) pair's output, its weights gathered by slot inside fixed-order
    reductions over the input dim (the compiler reads them in place, no copy). x [T, H] or [T, K, H]; slots [T, K]
    -> [T, K, H]."""
    return pair_products(x, w13[slots], w2[slots], act, bias)


def pair_products(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: Act, bias: PairBias | None
) -> torch.Tensor:
    """Each pair's expert output from its own weights w13 [T, K, 2I, H], w2 [T, K, H, I], in fixed-order reductions
    over the input dim. x [T, H] or [T, K, H] -> [T, K, H]."""
    rows = x[:, None, None, :] if x.dim() == 2 else x[:, :, None, :]  # [T, 1 or K, 1, H]
    gate_up = (rows * w13).sum(-1)  # [T, K, 2I]
    if bias is not None:
        gate_up = gate_up + bias.b13.view(*w13.shape[:2], -1)
    out = (act(gate_up)[:, :, None, :] * w2).sum(-1)
    return out if bias is None else out + bias.b2.view(*w13.shape[:2], -1)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum over k of weights[t, k] * y[t * K + k], in a fixed order: the same for every row, whatever the batch.
    y [T * K, H] in pair order; weights [T, K]. In the wider of the two dtypes, rounded to y's once: fp32 router
    weights weigh bf16 expert outputs in fp32, as transformers (5.x) does, not rounded to bf16 first."""
    n_tokens, k = weights.shape
    return (y.view(n_tokens, k, -1) * weights[..., None]).sum(dim=1).to(y.dtype)


def grouped(
    x: torch.Tensor,
    rows_of: torch.Tensor,
    flat: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """The expert output of pairs (row `rows_of[p]` of x, slot `flat[p]`), [P, H] in pair order.

    Pairs are grouped by slot (in pair order within a slot) and each used slot's rows padded to whole tiles (zero
    rows), so every slot's group is a matrix of TILE-multiple rows that meets its expert in one matrix product, as
    `linear` would compute it (tested bit for bit). Where the used slots are dense in their range, one
    `torch._grouped_mm` over the range computes them all; it visits empty groups too (~2 us each here), so sparse
    slots (a decode step's few experts in a big pager pool), and experts whose widths `torch._grouped_mm` does not
    take, are computed one slot at a time instead (the same bits: tested). A pair's result
    does not depend on the other pairs, so pairs can be computed in parts (resident experts first, then the late
    ones). The layout is worked out on Python lists: a pass has at most a few thousand pairs, and a dozen small
    tensor ops cost more than that loop at decode sizes."""
    pair_rows, pad_row = rows_of.tolist(), x.shape[0]  # pads read the zero row appended to x
    by_slot: dict[int, list[int]] = {}
    for p, slot in enumerate(flat.tolist()):
        by_slot.setdefault(slot, []).append(p)
    used = sorted(by_slot)
    rows: list[int] = []
    dest = [0] * len(pair_rows)  # padded row of each pair
    bounds, sizes = [], []
    for slot in used:
        for p in by_slot[slot]:
            dest[p] = len(rows)
            rows.append(pair_rows[p])
        n = len(by_slot[slot])
        rows.extend([pad_row] * (-n % TILE))
        sizes.append(n + -n % TILE)
        bounds.append(len(rows))
    xs = torch.cat([x, x.new_zeros(1, x.shape[1])])[torch.tensor(rows)]
    at = torch.tensor(dest)
    lo, hi = used[0], used[-1]
    # (torch._grouped_mm takes rows of whole 16-byte multiples only: a bf16 hidden or expert width of 36 it refuses)
    aligned = all(n * w13.element_size() % 16 == 0 for n in (w13.shape[2], w2.shape[2]))
    if aligned and 2 * len(used) > hi - lo:  # dense: one grouped product over the range, empty groups included
        per_group = [0] * (hi - lo + 1)
        for slot, size in zip(used, sizes, strict=True):
            per_group[slot - lo] = size
        offs = torch.tensor(per_group).cumsum(0).to(torch.int32)
        w13, w2 = w13[lo : hi + 1].transpose(1, 2), w2[lo : hi + 1].transpose(1, 2)
        gate_up = torch._grouped_mm(xs, w13, offs=offs)
        out = torch._grouped_mm(act(add_at(gate_up, at, bias)), w2, offs=offs)
    else:
        gate_up = per_slot(xs, w13.transpose(1, 2), used, bounds)
        out = per_slot(act(add_at(gate_up, at, bias)), w2.transpose(1, 2), used, bounds)
    return out[at] if bias is None else out[at] + bias.b2


def add_at(y: torch.Tensor, at: torch.Tensor, bias: PairBias | None) -> torch.Tensor:
    """y with each pair's b13 added at its padded row `at[p]` (pad rows untouched); y itself when no bias."""
    if bias is None:
        return y
    return y.index_put((at,), bias.b13, accumulate=True)


def per_slot(xs: torch.Tensor, wt: torch.Tensor, used: list[int], bounds: list[int]) -> torch.Tensor:
    """Rows bounds[g-1]:bounds[g] of xs times wt[used[g]], for each used slot g. wt [S, in, out] (transposed)."""
    out = xs.new_empty(xs.shape[0], wt.shape[2])
    first = 0
    for slot, end in zip(used, bounds, strict=True):
        torch.mm(xs[first:end], wt[slot], out=out[first:end])
        first = end
    return out


def dispatch_staged(
    x: torch.Tensor,
    slots: torch.Tensor,
    pending: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    wait: Callable[[], None],
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """`dispatch` while some experts are still loading (`pending` [T, K]): the resident ones compute first, then
    `wait()`, then the rest. Bit-identical to `dispatch` once everything is resident."""
    rows, rows_of = pair_rows(x, slots.shape[1])
    y = staged_pairs(rows, rows_of, slots.reshape(-1), pending.reshape(-1), w13, w2, wait, act, bias)
    return weighted_sum(y, weights)


def staged_pairs(
    rows: torch.Tensor,
    rows_of: torch.Tensor,
    flat: torch.Tensor,
    late: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    wait: Callable[[], None],
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """`grouped` while the pairs marked `late` [P] wait for their experts: the others first, then `wait()`, then
    those. -> [P, H] in pair order."""
    pairs = torch.arange(flat.numel())
    y = rows.new_empty(flat.numel(), rows.shape[-1])
    early = pairs[~late]
    if early.numel():
        y[early] = grouped(rows, rows_of[early], flat[early], w13, w2, act, None if bias is None else bias.take(early))
    wait()
    late_pairs = pairs[late]
    if late_pairs.numel():
        y[late_pairs] = grouped(rows, rows_of[late_pairs], flat[late_pairs], w13, w2, act,
                                None if bias is None else bias.take(late_pairs))  # fmt: skip
    return y


def run_experts(
    x: torch.Tensor,
    layer: int,
    ids: torch.Tensor,
    weights: torch.Tensor,
    provider: ExpertProvider,
    act: Act = swiglu,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum for rows x [T, H] (or one input per pair, [T, K, H]); `bias`: per-expert
    (b13 [E, 2I], b2 [E, H]) or None. Eager: each pair's output (`pair_outputs`, or the provider's own
    `pair_outputs` where other processes compute its experts: moelane.dist), then their weighted sum in one fixed
    order (`weighted_sum`)."""
    pairs = pair_bias(bias, ids)
    if not torch.compiler.is_compiling():
        rows, rows_of = pair_rows(x, ids.shape[1])
        spread = getattr(provider, "pair_outputs", None)
        if spread is not None:
            return weighted_sum(spread(rows, rows_of, layer, ids, act, pairs), weights)
        return weighted_sum(pair_outputs(rows, rows_of, layer, ids, provider, act, pairs), weights)
    slots, pools = provider.slots(layer, ids), provider.pools(layer)
    if computes_in_kernels(pools):
        return kernel_dispatch(x, slots, weights, pools, act, pairs)
    native = native_pool(pools, slots)
    if native is None:
        return dispatch_tiers(x, slots, weights, pools, act, pairs)
    return dispatch(x, slots, weights, native[0], native[1], act, pairs)


def pair_outputs(
    rows: torch.Tensor,
    rows_of: torch.Tensor,
    layer: int,
    ids: torch.Tensor,
    provider: ExpertProvider,
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """Each pair's expert output, unweighted, [P, H] in pair order (eager): pair p reads row `rows_of[p]` of rows
    [R, H] and computes expert `ids.reshape(-1)[p]`; `ids` in the shape the provider is asked with ([T, K] in a
    pass). What `run_experts` sums. A pair's bits depend only on its row and its expert's weights, so any subset of
    the pairs, computed anywhere with the same weights, gives each the same bits."""
    staged = getattr(provider, "slots_staged", None)
    slots, pending, wait = staged(layer, ids) if staged is not None else (provider.slots(layer, ids), None, None)
    flat, late = slots.reshape(-1), None if pending is None else pending.reshape(-1)
    pools = provider.pools(layer)
    if computes_in_kernels(pools):
        return kernel_pairs(rows, rows_of, flat, pools, act, bias, late, wait)
    native = native_pool(pools, slots)
    if native is None:
        if wait is not None:
            wait()  # (the reference path computes once every slot has loaded)
        return tier_pairs(rows, rows_of, flat, pools, act, bias)
    w13, w2 = native
    if late is None or wait is None:
        return grouped(rows, rows_of, flat, w13, w2, act, bias)
    return staged_pairs(rows, rows_of, flat, late, w13, w2, wait, act, bias)


def native_pool(pools: tuple[TierPool, ...], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w13, w2) of the first pool when it is native from slot 0 and holds every pair's slot, else None. A provider
    with that one pool (all resident in the compute dtype) is decided without looking at the slots, so its compiled
    step has nothing data-dependent here."""
    head = pools[0]
    if head.kind != "native" or head.first != 0:
        return None
    if len(pools) > 1 and (torch.compiler.is_compiling() or int(slots.max()) >= head.n_slots):
        return None
    return head.w13[0], head.w2[0]


# ---- the kernels' path: products from the pools' own bytes -------------------------------------------------------


def computes_in_kernels(pools: tuple[TierPool, ...]) -> bool:
    """Whether the pools are computed by `moelane.kernels` (`kernel_dispatch`): wherever the extension serves (every
    pool has its `kernel` view), at any tier and dtype; else the BLAS paths above (native pools) or the reference
    path below (quantised ones)."""
    return all(p.kernel is not None for p in pools)


def kernel_dispatch(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pools: tuple[TierPool, ...],
    act: Act = swiglu,
    bias: PairBias | None = None,
    pending: torch.Tensor | None = None,
    wait: Callable[[], None] | None = None,
) -> torch.Tensor:
    """`dispatch` through the kernels' `gather_linear`, which reads each used slot's bytes once per call, at any tier,
    dequantising in registers. With `pending` (pairs whose experts are still loading) the others compute first,
    then `wait()`, then the rest, as `dispatch_staged` does. A pair's numbers depend only on its row and its slot:
    gather_linear's products are batch-invariant (moelane.kernels), each rounded once to x's dtype, the activation
    and biases element-wise."""
    rows, rows_of = pair_rows(x, slots.shape[1])
    late = None if pending is None else pending.reshape(-1)
    return weighted_sum(kernel_pairs(rows, rows_of, slots.reshape(-1), pools, act, bias, late, wait), weights)


def kernel_pairs(
    rows: torch.Tensor,
    rows_of: torch.Tensor,
    flat: torch.Tensor,
    pools: tuple[TierPool, ...],
    act: Act = swiglu,
    bias: PairBias | None = None,
    late: torch.Tensor | None = None,
    wait: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The pairs' outputs [P, H] through `gather_linear` (pair p: row rows_of[p] of rows, slot flat[p]); with `late`
    [P] marked, the others first, then `wait()`, then those."""
    xf = rows.float()
    # (the kernel reads its indices where x is: a pager's slots and marks come from host-side tables)
    rows_of, flat = rows_of.to(xf.device), flat.to(xf.device)
    if late is None or wait is None:
        return pool_pairs(xf, rows_of, flat, pools, act, bias, rows.dtype)
    late = late.to(xf.device)
    y = rows.new_empty(flat.numel(), rows.shape[-1])
    pairs = torch.arange(flat.numel(), device=xf.device)
    for part in (pairs[~late], None, pairs[late]):
        if part is None:
            wait()
        elif part.numel():
            y[part] = pool_pairs(xf, rows_of[part], flat[part], pools, act, None if bias is None else bias.take(part),
                                 rows.dtype)  # fmt: skip
    return y


def pool_pairs(
    xf: torch.Tensor,
    rows_of: torch.Tensor,
    flat: torch.Tensor,
    pools: tuple[TierPool, ...],
    act: Act,
    bias: PairBias | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Each pair's expert output [P, H] in `dtype`, from whichever pool holds its slot. xf [R, H] float32."""
    if len(pools) == 1:  # (no data-dependent split: the compiled step's case, one resident pool)
        head = pools[0]
        return slot_pairs(xf, rows_of, flat if head.first == 0 else flat - head.first, head, act, bias, dtype)
    y = xf.new_empty(flat.numel(), xf.shape[1], dtype=dtype)
    for pool in pools:
        inside = ((flat >= pool.first) & (flat < pool.first + pool.n_slots)).nonzero().reshape(-1)
        if inside.numel():
            y[inside] = slot_pairs(xf, rows_of[inside], flat[inside] - pool.first, pool, act,
                                   None if bias is None else bias.take(inside), dtype)  # fmt: skip
    return y


def slot_pairs(
    xf: torch.Tensor,
    rows_of: torch.Tensor,
    local: torch.Tensor,
    pool: TierPool,
    act: Act,
    bias: PairBias | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The expert outputs [P, H] of pairs (row rows_of[p] of xf, slot local[p] of `pool`): down(act(gate_up + b13))
    + b2, each product in fp32 and rounded to `dtype` once, as a `dtype` matrix product with fp32 sums rounds it."""
    assert pool.kernel is not None
    w13, w2 = pool.kernel
    gate_up = kernels.gather_linear(xf, rows_of, local, w13).to(dtype)
    if bias is not None:
        gate_up = gate_up + bias.b13
    h = act(gate_up).float()
    out = kernels.gather_linear(h, torch.arange(local.numel(), device=h.device), local, w2).to(dtype)
    return out if bias is None else out + bias.b2


# ---- the reference path for quantised and mixed tiers ------------------------------------------------------------


def dispatch_tiers(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pools: tuple[TierPool, ...],
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """`dispatch` for pairs whose slots lie in any of `pools`, at any tier: the REFERENCE PATH, in plain torch, that
    the `gather_linear` kernel (which reads codes and scales in place) is to replace.

    Eager: the distinct slots the pairs use are dequantised into the compute dtype (`dequantized_slots`), then
    computed as `grouped` computes native slots. Compiled: each pair's weights are dequantised by slot
    (`pair_weights`) and meet its row in `pair_products`' fixed-order reductions, with nothing data-dependent, so the
    step compiles whole. A pair's result depends only on its row and its slot's weights: each weight's value is
    code * scale in fp32 (exact), rounded once to the compute dtype, whichever other slots share the call."""
    n_in = (x.shape[-1], pools[0].width)  # (H, I): the input widths of w13 and w2
    if torch.compiler.is_compiling():
        w13, w2 = pair_weights(pools, slots, x.dtype, n_in)
        y = pair_products(x, w13, w2, act, bias)
        return weighted_sum(y.reshape(-1, y.shape[-1]), weights)
    rows, rows_of = pair_rows(x, slots.shape[1])
    return weighted_sum(tier_pairs(rows, rows_of, slots.reshape(-1), pools, act, bias), weights)


def tier_pairs(
    rows: torch.Tensor,
    rows_of: torch.Tensor,
    flat: torch.Tensor,
    pools: tuple[TierPool, ...],
    act: Act = swiglu,
    bias: PairBias | None = None,
) -> torch.Tensor:
    """The reference path's pair outputs [P, H] (eager): the used slots dequantised, then `grouped`."""
    n_in = (rows.shape[-1], pools[0].width)  # (H, I)
    used, local = torch.unique(flat, return_inverse=True)  # used slots ascending; each pair's index
    w13, w2 = dequantized_slots(pools, used, rows.dtype, n_in)
    return grouped(rows, rows_of, local, w13, w2, act, bias)


def dequantized(
    kind: str, part: tuple[torch.Tensor, torch.Tensor | None], index: torch.Tensor, n_in: int, dtype: torch.dtype
) -> torch.Tensor:
    """The matrices `part` holds at pool slots `index` [...], in `dtype`: [..., Out, In]. int8: code * scale; int4:
    (nibble - 8) * scale, low nibble first; each product exact in fp32, then rounded to `dtype` once, as
    `tiers.dequantize` followed by a copy into a `dtype` tensor gives."""
    data, scales = part
    if kind == "native":
        return data[index]
    assert scales is not None, f"a {kind} pool without scales"
    codes, s = data[index], scales[index]  # [..., Out, In_p] int8, or [..., Out, In_p / 2] uint8; [..., Out, G]
    if kind == "int8" and data.dim() == 4:  # interleaved (kernels/pool.py)
        codes, s = rows_major(codes, s)
    if kind == "int8":
        values = codes.float()
    else:
        values = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2).float() - 8.0
    s = s.float()
    w = (values.view(*values.shape[:-1], s.shape[-1], -1) * s[..., None]).flatten(-2)
    out: torch.Tensor = w[..., :n_in].to(dtype)
    return out


def dequantized_slots(
    pools: tuple[TierPool, ...], used: torch.Tensor, dtype: torch.dtype, n_in: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The used slots' matrices, each from its own pool, in `dtype`: (w13 [U, 2I, H], w2 [U, H, I])."""
    n_used, (hidden, width) = used.numel(), n_in
    device = pools[0].w13[0].device
    w13 = torch.empty(n_used, 2 * width, hidden, dtype=dtype, device=device)
    w2 = torch.empty(n_used, hidden, width, dtype=dtype, device=device)
    for pool in pools:
        inside = ((used >= pool.first) & (used < pool.first + pool.n_slots)).nonzero().reshape(-1)
        if inside.numel():
            local = used[inside] - pool.first
            w13[inside] = dequantized(pool.kind, pool.w13, local, hidden, dtype)
            w2[inside] = dequantized(pool.kind, pool.w2, local, width, dtype)
    return w13, w2


def pair_weights(
    pools: tuple[TierPool, ...], slots: torch.Tensor, dtype: torch.dtype, n_in: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's matrices, from whichever pool holds its slot, in `dtype`: (w13 [T, K, 2I, H], w2 [T, K, H, I]).
    Every pool is read at every pair (its index clamped into range) and the pair's own pool chosen with `where`:
    tensor ops only, for the compiled step."""
    hidden, width = n_in
    w13 = w2 = None
    for pool in pools:
        local = slots - pool.first if len(pools) == 1 else (slots - pool.first).clamp(0, pool.n_slots - 1)
        a = dequantized(pool.kind, pool.w13, local, hidden, dtype)
        b = dequantized(pool.kind, pool.w2, local, width, dtype)
        if w13 is None or w2 is None:
            w13, w2 = a, b
            continue
        inside = ((slots >= pool.first) & (slots < pool.first + pool.n_slots))[..., None, None]
        w13, w2 = torch.where(inside, a, w13), torch.where(inside, b, w2)
    assert w13 is not None and w2 is not None
    return w13, w2
