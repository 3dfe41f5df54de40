"""The store's pools: one per precision tier, in anonymous memory that commits pages as slots fill and returns them
as slots empty, so the process's resident memory follows the bytes the store holds.

A pool of S slots is one private anonymous mapping (`mmap.mmap(-1, n)`, its pages untouched until a load writes them)
holding its tier's parts (`tiers.slot_parts`: native w13, w2; quantised codes13, scales13, codes2, scales2), each a
contiguous [S, Out, X] tensor starting on a page boundary: the pool formats of `moelane.model.provider`, contiguous
as the `gather_linear` kernel takes them. One expert's slot is then 2 or 4 runs of bytes, one in each part.

Pages: when a slot empties and is not reused at once, `release` returns (MADV_DONTNEED) every page of its runs that
no held slot overlaps: its interior pages at once, a page it shares with a neighbour once that neighbour is empty
too. Beyond the held bytes, the pool so commits at most the partial pages at the ends of runs of held slots (one a
part at each end: 8 KiB a run in a native pool, 16 KiB in a quantised one, against experts of megabytes). Slots are
not padded to whole pages, which would cost a tiny expert's quantised slot up to a whole page and make the slot
stride of each part differ from its matrices' size. Transparent huge pages are refused for the mapping
(MADV_NOHUGEPAGE): one 2 MiB page would commit memory that no slot holds.

On a device (`device` given: a CUDA device, transfer.py), each part is one `torch.empty` [S, Out, X] tensor there,
allocated once with the pool: the device pool is the budget, so `release` returns nothing. Shapes, dtypes, contiguity
and slot numbering are the host pool's.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from moelane.kernels.formats import QuantFormat
from moelane.model.provider import TIER_KINDS, TierPool, tier_pool
from moelane.pager.live.slots import EMPTY
from moelane.pager.live.tiers import slot_parts

PAGE = mmap.PAGESIZE


class PagedPool:
    """One tier's pool of `n_slots` slots, the provider's slots `first ..< first + n_slots`."""

    def __init__(
        self, tier: int, dims: tuple[int, int], dtype: torch.dtype, n_slots: int, first: int,
        fmt: QuantFormat | None = None, device: torch.device | None = None,
    ) -> None:  # fmt: skip
        parts = slot_parts(tier, *dims, dtype, fmt, interleave=device is None)
        self.tier, self.first, self.n_slots, self.device = tier, first, n_slots, device
        self.slot_bytes = [dtype.itemsize * math.prod(shape) for dtype, shape in parts]
        self.offsets, size = [], 0
        if device is not None:
            self._map: mmap.mmap | None = None
            self.tensors = tuple(torch.empty((n_slots, *shape), dtype=dtype, device=device) for dtype, shape in parts)
        else:
            for per_slot in self.slot_bytes:
                self.offsets.append(size)
                size += -(-per_slot * n_slots // PAGE) * PAGE
            self._map = mmap.mmap(-1, max(size, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(OSError, AttributeError):  # (where the OS has no such advice: no such pages)
                self._map.madvise(mmap.MADV_NOHUGEPAGE)
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
            self.tensors = tuple(
                raw[offset : offset + per_slot * n_slots].view(dtype).view(n_slots, *shape)
                for offset, per_slot, (dtype, shape) in zip(self.offsets, self.slot_bytes, parts, strict=True)
            )
        t = self.tensors
        w13, w2 = ((t[0], None), (t[1], None)) if tier == 0 else ((t[0], t[1]), (t[2], t[3]))
        self.tier_pool = tier_pool(first, TIER_KINDS[tier], w13, w2, dims)

    def slot(self, index: int) -> tuple[torch.Tensor, ...]:
        """The parts of the pool's slot `index` (counted from its first): views to load an expert into."""
        return tuple(t[index] for t in self.tensors)

    def release(self, index: int, state: npt.NDArray[np.int8]) -> int:
        """Return the pages of slot `index` (empty now) that no held slot overlaps; `state` [n_slots]: the slot
        table's states of the pool's slots. -> bytes returned (none on a device: its pool is allocated once)."""
        if self._map is None:
            return 0
        returned = 0
        for offset, per_slot in zip(self.offsets, self.slot_bytes, strict=True):
            start, end = offset + index * per_slot, offset + (index + 1) * per_slot
            lo, hi = start // PAGE, (end - 1) // PAGE  # the pages the slot touches
            if lo * PAGE < start and (state[(lo * PAGE - offset) // per_slot : index] != EMPTY).any():
                lo += 1  # shared with a held slot before it
            after = state[index + 1 : ((hi + 1) * PAGE - 1 - offset) // per_slot + 1]
            if (hi + 1) * PAGE > end and (after != EMPTY).any():
                hi -= 1  # shared with a held slot after it
            if hi >= lo:
                self._map.madvise(mmap.MADV_DONTNEED, lo * PAGE, (hi - lo + 1) * PAGE)
                returned += (hi - lo + 1) * PAGE
        return returned


class TierPools:
    """The store's pools, one a tier, each made when its tier is first used: tier t's slots are the provider's
    `first[t] ..< first[t] + capacity[t]`, whether or not its pool exists yet; a quantised tier's in `formats[t]`
    (`tiers.tier_format`); on `device` (None: host memory)."""

    def __init__(self, dims: tuple[int, int], dtype: torch.dtype, first: Sequence[int], capacity: Sequence[int],
                 formats: dict[int, QuantFormat], device: torch.device | None = None):  # fmt: skip
        self.dims, self.dtype, self.formats, self.device = dims, dtype, formats, device
        self.first, self.capacity = [int(f) for f in first], [int(c) for c in capacity]
        self.by_tier: dict[int, PagedPool] = {}
        self.tier_pools: tuple[TierPool, ...] = ()  # those made, ascending `first` (the provider's `pools`)

    def use(self, tier: int) -> None:
        if tier not in self.by_tier:
            self.by_tier[tier] = PagedPool(tier, self.dims, self.dtype, self.capacity[tier], self.first[tier],
                                          self.formats.get(tier), self.device)  # fmt: skip
            self.tier_pools = tuple(sorted((p.tier_pool for p in self.by_tier.values()), key=lambda p: p.first))

    def slot(self, tier: int, slot: int) -> tuple[torch.Tensor, ...]:
        """The parts of the provider's slot `slot`, of tier `tier`."""
        pool = self.by_tier[tier]
        return pool.slot(slot - pool.first)

    def release(self, slots: Sequence[int], tiers: npt.NDArray[np.int8], state: npt.NDArray[np.int8]) -> None:
        """Return the pages of these emptied slots; `tiers`, `state`: the slot table's, for every slot."""
        for slot in slots:
            pool = self.by_tier[int(tiers[slot])]
            pool.release(slot - pool.first, state[pool.first : pool.first + pool.n_slots])
