"""Building blocks shared by the model families: projections, elementwise functions, norms and the dense MLPs.
Rotary embeddings live in `rope.py`; attention over the KV caches, built from these, in `attention.py`.

Batch invariance (docs/batch-invariance.md): a row's numbers must not depend on which other rows share the pass.
Every projection goes through `linear`, which pads the rows to whole tiles of `TILE` so each row always meets the same
matrix kernel; transcendental elementwise functions go through `pointwise`, which keeps every element on the
vectorised path. Nothing here takes a Python scalar from a tensor, so a decode step compiles whole.

Shape alphabet: N rows in the pass, H hidden, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moelane.kernels import Pool
from moelane.kernels import linear as kernel_linear

TILE = 16
# PyTorch's CPU elementwise kernels run two vectors at a time and finish the last `numel % (2 x lanes)` elements with
# scalar code, whose exp (silu, sigmoid) can differ from the vectorised one in the last bit; above GRAIN elements the
# range is split evenly across threads, each part with its own tail. 64 elements are two AVX-512 vectors of bf16 (and
# four of fp32).
VECTOR_BLOCK = 64
GRAIN = 32768  # at::internal::GRAIN_SIZE


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Pad dim -2 up to a whole number of tiles (zeros)."""
    n = x.shape[-2]
    extra = -n % TILE
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def linear(
    x: torch.Tensor, w: torch.Tensor | Pool, b: torch.Tensor | None = None, exact_out: bool = False
) -> torch.Tensor:
    """`x @ w.T + b`, batch-invariant: rows are computed in tiles of TILE whatever their count.

    Under torch.compile it is written as a fixed-order reduction instead, which the compiler fuses into one kernel at
    the memory roofline (a matrix-vector product through the BLAS reaches about half of it here; ANCHORS.md). A
    weight that is a kernels' `Pool` (f32, bf16 or quantised: `model/weights.py`) goes through the kernels, eager or
    compiled: fp32 products of each row in a fixed order, rounded to x's dtype once, or (`exact_out`: LM heads)
    left in fp32, as llama.cpp leaves its logits: bf16 logits tie often (8 bits of mantissa over a vocabulary), and
    argmax would then break the tie by token id."""
    if isinstance(w, Pool):
        y = kernel_linear(x.float(), w)
        y = y if exact_out else y.to(x.dtype)
        return y if b is None else y + b
    if torch.compiler.is_compiling():
        y = (x[:, None, :] * w[None]).sum(-1)
        return y if b is None else y + b
    n = x.shape[0]
    return F.linear(pad_rows(x), w, b)[:n]


def linear_parts(x: torch.Tensor, w: Pool, parts: Sequence[tuple[int, torch.Tensor | None]]) -> list[torch.Tensor]:
    """`linear` of a pool whose rows are several projections' (`Attention.fuse_projections`), parts [(rows, bias)]
    in row order -> each part's output, rounded to x's dtype and biased apart, as its own `linear` does it. The same
    bits as the separate products, eager and in float32; compiled in bf16, Inductor leaves out some roundings to bf16
    where it fuses a cast with what reads it, and which it fuses depends on the graph, so there the bits may differ
    from the separate products' (a row's bits still do not depend on the other rows)."""
    y = kernel_linear(x.float(), w)
    return [t.to(x.dtype) if b is None else t.to(x.dtype) + b
            for t, (_, b) in zip(torch.split(y, [n for n, _ in parts], dim=-1), parts, strict=True)]  # fmt: skip


def whole_vectors(n: int) -> int:
    """The smallest size >= n that every thread's part of an elementwise kernel covers with whole vector blocks."""
    threads, size = torch.get_num_threads(), n
    while True:
        parts = max(1, min(threads, -(-size // GRAIN)))
        padded = -(-size // (VECTOR_BLOCK * parts)) * VECTOR_BLOCK * parts
        if padded == size:
            return size
        size = padded


def pointwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """`fn(*xs)` for an elementwise `fn` of same-shaped tensors, batch-invariant: computed on flat copies padded to
    `whole_vectors`, so no element lands in a scalar tail, whose position would depend on the other rows of the pass
    (measured: silu differed in the last bit on AVX-512 without this). Under torch.compile, plain `fn(*xs)`."""
    if torch.compiler.is_compiling():
        return fn(*xs)
    shape, n = xs[0].shape, xs[0].numel()
    extra = whole_vectors(n) - n
    return fn(*(F.pad(x.reshape(-1), (0, extra)) for x in xs))[:n].view(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up`, batch-invariant."""
    return pointwise(lambda g, u: F.silu(g) * u, gate, up)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RMSNormScaledFp32(RMSNorm):
    """RMSNorm that applies its weight in fp32 and rounds once, as gpt-oss does (the same numbers in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class MLP(nn.Module):
    """Dense SwiGLU feed-forward (dense layers, shared experts); `bias` for Llama/DeepSeek `mlp_bias`."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = linear(x, self.gate_proj.weight, self.gate_proj.bias)
        h = silu_mul(gate, linear(x, self.up_proj.weight, self.up_proj.bias))
        return linear(h, self.down_proj.weight, self.down_proj.bias)


class FusedMLP(nn.Module):
    """A SwiGLU MLP whose gate and up projections are one matrix (`input_linear`, gate rows first), as Granite stores
    its shared MLP (and, stacked, its experts)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * width, bias=False)
        self.output_linear = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.input_linear.weight).chunk(2, dim=-1)
        return linear(silu_mul(gate, up), self.output_linear.weight)
