"""Experts computed by the kernels from the pools' own bytes (`experts.kernel_dispatch`): each token's output is the
dequantised experts' within fp32 rounding, at every tier and with tiers mixed; its bits depend only on its row and
its slots (other tokens, loading order); `run_experts` takes this path for pools with a kernels' view; a model held
resident at int8 or int4 gives the logits of its dequantised experts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moelane
import moelane.model.experts as experts_module
from moelane import kernels
from moelane.model.cache import Rows
from moelane.model.experts import kernel_dispatch, run_experts
from moelane.model.provider import TierPool, tier_pool
from tests.helpers import random_model
from tests.model.test_experts_tiers import Pools, experts, quantised_pool, reference

pytestmark = pytest.mark.skipif(kernels.available().backend == "fallback", reason="the kernels' extension is needed")


def with_kernels(pool: TierPool, hidden: int, width: int) -> TierPool:
    return tier_pool(pool.first, pool.kind, pool.w13, pool.w2, (hidden, width))


def pools_of(kinds: tuple[str, ...], hidden: int, width: int, seed: int) -> tuple[TierPool, ...]:
    pools, first = [], 0
    for i, kind in enumerate(kinds):
        pool = quantised_pool(*experts(4 + i, hidden, width, seed + i), kind, first)
        pools.append(with_kernels(pool, hidden, width))
        first += pool.n_slots
    return tuple(pools)


def routed(n_tokens: int, n_slots: int, k: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=gen)
    slots = torch.stack([torch.randperm(n_slots, generator=gen)[:k] for _ in range(n_tokens)])
    return x, slots, torch.rand(n_tokens, k, generator=gen)


@pytest.mark.parametrize("kinds", [("int8",), ("int4",), ("native",), ("native", "int8", "int4")])
@pytest.mark.parametrize(("hidden", "width"), [(64, 32), (40, 36)])  # whole groups; padded rows
def test_kernel_products_are_the_dequantised_experts(kinds: tuple[str, ...], hidden: int, width: int) -> None:
    pools = pools_of(kinds, hidden, width, seed=hidden)
    x, slots, weights = routed(9, sum(p.n_slots for p in pools), 3, hidden, seed=1)
    want = reference(x, slots, weights, pools, coded=True)
    got = kernel_dispatch(x, slots, weights, pools)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_bf16_rows_meet_bf16_pools_rounded_once_a_product() -> None:
    """bf16 activations with bf16 and int4 pools: each product summed in fp32, rounded to bf16 once, so within bf16's
    rounding of a few steps of the float64 reference; the output is bf16."""
    hidden, width = 64, 32
    w13, w2 = experts(4, hidden, width, 3)
    native = with_kernels(quantised_pool(w13.bfloat16(), w2.bfloat16(), "native"), hidden, width)
    int4 = with_kernels(quantised_pool(*experts(5, hidden, width, 4), "int4", first=4), hidden, width)
    assert native.kernel is not None and native.kernel[0].kind == "bf16"
    x, slots, weights = routed(6, 9, 2, hidden, seed=2)
    got = kernel_dispatch(x.bfloat16(), slots, weights, (native, int4))
    assert got.dtype == torch.bfloat16
    want = reference(x.bfloat16().float(), slots, weights, (native, int4))
    assert (got.double() - want).abs().max().item() <= 0.03 * want.abs().max().item()


def test_each_token_depends_only_on_its_row_and_slots() -> None:
    """Alone or among others, loaded first or late (`pending`), a token's output is the same bits."""
    hidden, width = 48, 24
    pools = pools_of(("native", "int8", "int4"), hidden, width, seed=5)
    x, slots, weights = routed(20, 15, 3, hidden, seed=6)
    together = kernel_dispatch(x, slots, weights, pools)
    for t in (0, 7, 19):
        alone = kernel_dispatch(x[t : t + 1], slots[t : t + 1], weights[t : t + 1], pools)
        assert torch.equal(alone[0], together[t])
    pending = torch.rand(slots.shape, generator=torch.Generator().manual_seed(7)) < 0.4
    waited: list[bool] = []
    staged = kernel_dispatch(x, slots, weights, pools, pending=pending, wait=lambda: waited.append(True))
    assert waited == [True] and torch.equal(staged, together)


def test_run_experts_computes_pools_with_a_kernels_view_in_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    hidden, width = 48, 24
    pools = pools_of(("int8", "int4"), hidden, width, seed=8)
    x, slots, weights = routed(5, 9, 2, hidden, seed=9)
    calls: list[int] = []
    want = kernel_dispatch(x, slots, weights, pools)
    real = experts_module.kernel_pairs
    monkeypatch.setattr(experts_module, "kernel_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run_experts(x, 0, slots, weights, Pools(pools, slots))
    assert calls == [1] and torch.equal(got, want)
    plain = tuple(TierPool(p.first, p.kind, p.w13, p.w2) for p in pools)  # no kernels' view: the reference path
    run_experts(x, 0, slots, weights, Pools(plain, slots))
    assert calls == [1]


@pytest.mark.parametrize("tier", ["int8", "int4"])
def test_a_model_resident_at_a_tier_computes_its_dequantised_experts(
    tier: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`default_tier` int8 / int4 with every expert resident: logits within their activations' coding of the same
    model computed by the reference path (dequantise, then the BLAS), and the experts' pools hold their tier's
    bytes."""
    folder = random_model("qwen3_moe", tmp_path_factory.mktemp("tiered"))
    lm = moelane.load(folder, expert_memory="100%", default_tier=tier)
    prompt = list(range(3, 30))
    got = lm.forward([Rows(lm.new_cache(64), prompt, 0)])[0]
    monkeypatch.setattr(experts_module, "computes_in_kernels", lambda pools: False)
    want = lm.forward([Rows(lm.new_cache(64), prompt, 0)])[0]
    # int8 and int4 products code their inputs to 8 bits (docs/kernels.md; exact against a coded reference above):
    # the reference path does not, so logits move by a few tenths of a percent there
    assert (got - want).abs().max().item() <= 5e-3 * want.abs().max().item()
    assert not torch.equal(got, lm_native_logits(folder, prompt))  # (the tier changed the numbers: it ran at the tier)


def lm_native_logits(folder: Any, prompt: list[int]) -> torch.Tensor:
    lm = moelane.load(folder)
    return lm.forward([Rows(lm.new_cache(64), prompt, 0)])[0]
