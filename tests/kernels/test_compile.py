"""torch.compile(fullgraph=True) of a function calling the op: no graph break, the op left in the graph as one
opaque call (so the kernel runs, not a decomposition), and the same bits as eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import EagerAndRecordGraphs

from moelane import kernels
from tests.kernels.helpers import random_pool


def moe_layer(x: torch.Tensor, slots: torch.Tensor, w13: kernels.Pool, w2: kernels.Pool) -> torch.Tensor:
    """x [T, H], slots [T, K] -> [T, K, H]: one MoE layer's expert products, SwiGLU between."""
    n_tokens, k = slots.shape
    rows = torch.arange(n_tokens).repeat_interleave(k)
    gate_up = kernels.gather_linear(x, rows, slots.flatten(), w13)  # [T*K, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return kernels.gather_linear(h, torch.arange(n_tokens * k), slots.flatten(), w2).view(n_tokens, k, -1)


@pytest.mark.slow  # (Inductor compiles the layer, ~10 s on a fresh machine)
def test_fullgraph_compile_calls_the_op(impl: str) -> None:
    w13, w2 = random_pool("int4", 4, 64, 48, seed=1), random_pool("int4", 4, 48, 32, seed=2)
    head = kernels.Pool("bf16", torch.randn(1, 48, 48).bfloat16())
    x = torch.randn(3, 48)
    slots = torch.tensor([[0, 2], [3, 2], [1, 0]])

    def layer(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return moe_layer(x, slots, w13, w2) + kernels.linear(x, head)[:, None, :]

    recorder = EagerAndRecordGraphs()
    torch._dynamo.reset()
    recorded = torch.compile(layer, backend=recorder, fullgraph=True)(x, slots)
    (graph,) = recorder.graphs
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.moelane.gather_linear.default]
    assert len(calls) == 3
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, slots), layer(x, slots))
    assert torch.equal(recorded, layer(x, slots))
