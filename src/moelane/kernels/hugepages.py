"""Host memory for weights that every decode pass streams: backed by 2 MiB pages where the system allows.

A product that streams weights from memory misses the TLB once per 4 KiB page it enters; on 2 MiB pages it misses
512 times less. On this machine (Linux transparent huge pages in `madvise` mode, the default of most distributions)
one inflated MoE layer streamed from such memory took 1-4% less time at int8 and bf16 (0-1.5% at int4) than from
ordinary pages, alternated in one process (bench/pages_ab.py, docs/kernels.md "Huge pages"). So resident expert
pools and dense weights are placed here; the expert store's slot pools are not (pager/live/pools.py: a 2 MiB page
would commit memory that no slot holds).

The memory is an anonymous mapping advised `MADV_HUGEPAGE` before anything touches it (pages are chosen at first
touch), its tensor starting on a 2 MiB boundary. Where transparent huge pages are off (`never`), or the platform has no
`madvise`, it is ordinary memory, and tensors under 2 MiB always are: nothing changes but the speed.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

from moelane.kernels.pool import Pool

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of `shape` and `dtype` in huge-page-advised memory (torch.empty's
    where it is under one huge page, or the platform cannot advise)."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.empty(shape, dtype=dtype)
    # Whole huge pages from a 2 MiB boundary: one more page of address space than the data needs (never touched,
    # so never committed).
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    block = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # (a kernel without transparent huge pages)
        block.madvise(advice)
    raw = torch.frombuffer(block, dtype=torch.uint8)  # (the tensor keeps the mapping alive)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def place(t: torch.Tensor) -> torch.Tensor:
    """`t` itself where it is not a CPU tensor or is under one huge page, else a contiguous copy in `empty`'s
    memory."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE:
        return t
    out = empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat(tensors, dim)` written straight into `empty`'s memory (torch.empty's under one huge page)."""
    first = tensors[0]
    if first.device.type != "cpu":
        return torch.cat(tensors, dim)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.cat(tensors, dim, out=empty(tuple(shape), first.dtype))


def place_pool(pool: Pool) -> Pool:
    """`pool` with its codes or values `place`d (its scales, a few % of its bytes, as they are)."""
    data = place(pool.data)
    return pool if data is pool.data else Pool(pool.kind, data, pool.scales, pool.in_features)
