"""`attend_cache`, the compiled decode step's attention over a KV pool read in place: against a float64 reference
for every pool dtype and head layout, with masks, windows and sinks; each row's bits alone or among others, however
far the call reads and at any thread count; compiled as one opaque call with eager's bits."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs

from moelane import kernels

# (query heads, KV heads, key dim, value dim): grouped, multi-query, multi-head with a value dim of its own (MLA),
# dims that are not a multiple of the kernel's 16 lanes
LAYOUTS = [(8, 4, 64, 64), (32, 4, 128, 128), (8, 1, 96, 80), (16, 16, 192, 128), (6, 2, 20, 36)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def reference(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
    sinks: torch.Tensor | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The same attention in float64, a row at a time."""
    n, n_heads, d = q.shape
    n_kv, length = k_pool.shape[1], mask.shape[1]
    group = n_heads // n_kv
    out = torch.empty(n, n_heads, v_pool.shape[3], dtype=torch.float64)
    for i in range(n):
        keys, values = k_pool[slots[i], :, :length].double(), v_pool[slots[i], :, :length].double()
        scores = torch.einsum("hgd,hld->hgl", q[i].double().view(n_kv, group, d), keys) * scale
        scores = scores.masked_fill(~mask[i], float("-inf"))
        if sinks is not None:
            scores = torch.cat([sinks.double().view(n_kv, group, 1), scores], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., -length:]
        out[i] = torch.einsum("hgl,hld->hgd", probs, values).reshape(n_heads, -1)
    return out


def case(
    layout: tuple[int, int, int, int], dtype: torch.dtype, sinks: bool, seed: int = 0, capacity: int = 120
) -> dict[str, torch.Tensor | None]:
    """Five slots of random caches, six rows at assorted positions (one with a sliding window), as the step calls it."""
    n_heads, n_kv, d, d_v = layout
    g = torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 17, capacity - 21, 100, 33, 90])
    mask = torch.arange(capacity - 20)[None] <= positions[:, None]
    mask[4, :10] = False  # a window: row 4 sees keys 10..33
    return dict(
        q=torch.randn(6, n_heads, d, generator=g).to(dtype),
        k_pool=torch.randn(5, n_kv, capacity, d, generator=g).to(dtype),
        v_pool=torch.randn(5, n_kv, capacity, d_v, generator=g).to(dtype),
        slots=torch.tensor([3, 0, 4, 3, 1, 2]),
        mask=mask,
        sinks=torch.randn(n_heads, generator=g) if sinks else None,
    )


def attend(c: dict[str, torch.Tensor | None], scale: float = 0.125) -> torch.Tensor:
    return kernels.attend_cache(c["q"], c["k_pool"], c["v_pool"], c["slots"], c["mask"], c["sinks"], scale)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sinks", [False, True])
def test_matches_a_float64_reference(impl: str, dtype: torch.dtype, layout: tuple[int, int, int, int],
                                     sinks: bool) -> None:  # fmt: skip
    c = case(layout, dtype, sinks)
    y = attend(c)
    assert y.dtype == dtype and y.shape == (6, layout[0], layout[3])
    exact = reference(**c, scale=0.125)  # type: ignore[arg-type]
    # fp32 throughout, rounded once to the pools' dtype
    assert ((y.double() - exact).abs() <= EPS[dtype] * exact.abs() + 1e-5).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_alone_further_and_at_any_thread_count(impl: str, dtype: torch.dtype,
                                                                      threads: None) -> None:  # fmt: skip
    c = case((8, 2, 64, 64), dtype, sinks=True)
    torch.set_num_threads(2)
    together = attend(c)
    assert c["mask"] is not None and c["q"] is not None and c["slots"] is not None
    wider = torch.zeros(6, 120, dtype=torch.bool)  # the call reads to the capacity: the extra keys are masked
    wider[:, : c["mask"].shape[1]] = c["mask"]
    for i in range(6):
        alone = kernels.attend_cache(c["q"][i : i + 1], c["k_pool"], c["v_pool"], c["slots"][i : i + 1],  # type: ignore[arg-type]
                                     wider[i : i + 1], c["sinks"], 0.125)  # fmt: skip
        assert torch.equal(alone[0], together[i])
    torch.set_num_threads(1)
    assert torch.equal(attend(c), together)


def test_other_slots_and_keys_past_a_row_do_not_reach_it(impl: str) -> None:
    c = case((8, 4, 64, 64), torch.float32, sinks=False)
    before = attend(c)
    assert c["k_pool"] is not None and c["v_pool"] is not None
    c["k_pool"][1:3] = float("nan")  # slots of no row but rows 4 and 5 ...
    c["v_pool"][:, :, 100:] = float("nan")  # ... and keys no row sees
    after = attend(c)
    assert torch.equal(after[[0, 1, 2, 3]], before[[0, 1, 2, 3]])
    assert after[4:].isnan().all()


@pytest.mark.slow  # (the compiled decode step runs the op compiled: tests/model/test_exported.py, slow too)
def test_compiled_it_is_one_call_with_eagers_bits(extension: kernels.Availability) -> None:
    c = case((8, 4, 64, 64), torch.bfloat16, sinks=True)

    def step(q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return kernels.attend_cache(q * 1, c["k_pool"], c["v_pool"], slots, mask, c["sinks"], 0.125)  # type: ignore[arg-type]

    args = (c["q"], c["slots"], c["mask"])
    recorder = EagerAndRecordGraphs()
    torch._dynamo.reset()
    torch.compile(step, backend=recorder, fullgraph=True)(*args)
    (graph,) = recorder.graphs
    assert sum(n.target is torch.ops.moelane.attend_cache.default for n in graph.graph.nodes) == 1
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(*args), step(*args))  # type: ignore[arg-type]


def test_bad_inputs_raise(extension: kernels.Availability) -> None:
    c = case((8, 4, 64, 64), torch.float32, sinks=False)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.attend_cache(c["q"], c["k_pool"], c["v_pool"], torch.tensor([0, 1, 2, 3, 4, 5]), c["mask"], None, 1.0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        pool = torch.zeros(5, 4, 300, 64, dtype=torch.float64)
        kernels.attend_cache(c["q"], pool, pool, c["slots"], c["mask"], None, 1.0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="heads do not group"):
        kernels.attend_cache(c["q"][:, :6], c["k_pool"][:, :4], c["v_pool"], c["slots"], c["mask"], None, 1.0)  # type: ignore[arg-type,index]
