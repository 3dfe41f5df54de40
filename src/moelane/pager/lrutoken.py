"""One decode token through an LRU-keyed pool, exactly as step by step, with O(layers) Python work.

Step by step, a decode token runs its L layer steps in order; each step evicts the lowest-keyed residents it does not
need. The residents at the token's start, sorted by key, form a queue S. Within the token nothing else enters S (what a
step loads or touches becomes the most recent), so every step evicts from the front of S, skipping the experts that an
earlier or the current layer already touched (they are fresh now) and evicting any that only a later layer needs (which
then miss there). A pointer over S with prefix sums of evictable units replaces the per-step search; only the few
experts of S that the token needs are visited one by one. Returns None when S runs out (the token's own fresh experts
would have to go, or hard pins): the caller then runs the steps one by one.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from moelane.pager.trace import IntArray


@dataclass(frozen=True, slots=True, eq=False)
class TokenOutcome:
    evicted: IntArray  # ids evicted during the token
    hit: IntArray  # [L*K] bool: hit at its step
    free_after: int  # free units after the token


def lru_token(
    ids2: IntArray,  # [L, K] flat ids of the token, layer by layer
    resident: IntArray,
    hard: IntArray,
    units: IntArray,
    load_units: IntArray,  # [L*K] units each id would take if loaded
    last: IntArray,  # last access step of every id
    bias: IntArray,  # pin credit of every id (steps)
    free: int,
) -> TokenOutcome | None:
    n_layers, k = ids2.shape
    ids = ids2.reshape(-1)
    res0 = resident[ids]
    cand = np.flatnonzero(resident & ~hard)
    # LRU key: last + credit, then the larger id first (the simulator's key; equal keys sort by id descending)
    keys = (last[cand] + bias[cand]) * resident.size + (resident.size - 1 - cand)
    queue = cand[np.argsort(keys)]
    pos_of = np.full(resident.size, -1, np.int64)
    pos_of[queue] = np.arange(queue.size)
    old = res0 & (pos_of[ids] >= 0)  # needed by the token and in the queue
    old_pos = pos_of[ids[old]]
    always = np.ones(queue.size, np.int64)
    always[old_pos] = 0
    c_arr = np.concatenate([[0], np.cumsum(units[queue] * always)])
    order = np.argsort(old_pos)
    n_pos: list[int] = old_pos[order].tolist()
    n_slot: list[int] = np.flatnonzero(old)[order].tolist()  # index into ids
    n_units: list[int] = units[ids[old]][order].tolist()
    per_layer_miss = np.where(res0, 0, load_units).reshape(n_layers, k).sum(axis=1)
    old_layer = np.flatnonzero(old) // k
    quick = _no_conflict(per_layer_miss, free, c_arr, queue, always, old_pos, old_layer, units, load_units)
    if quick is not None:
        return TokenOutcome(quick[0], res0.copy(), quick[1])
    miss_units = per_layer_miss.tolist()
    c = c_arr.tolist()
    hit = res0.copy()
    p, ni, n_old, n_queue = 0, 0, len(n_pos), queue.size
    for j in range(n_layers):
        need = miss_units[j] - free
        if need <= 0:
            free -= miss_units[j]
            continue
        got = 0
        while True:
            q = n_pos[ni] if ni < n_old else n_queue
            avail = c[q] - c[p]
            if got + avail >= need:
                p2 = bisect_left(c, c[p] + need - got, p, q + 1)
                got += c[p2] - c[p]
                p = p2
                break
            got += avail
            if q == n_queue:
                return None
            slot = n_slot[ni]
            layer = slot // k
            if layer > j:  # needed only later: evicted now, misses at its layer
                got += n_units[ni]
                hit[slot] = False
                miss_units[layer] += int(load_units[slot])
            p, ni = q + 1, ni + 1
        free += got - miss_units[j]
    consumed = queue[:p]
    evicted_always = consumed[always[:p] == 1]
    evicted_needed = ids[old & ~hit]
    return TokenOutcome(np.concatenate([evicted_always, evicted_needed]), hit, free)


def _no_conflict(
    per_layer_miss: IntArray,
    free: int,
    c: IntArray,
    queue: IntArray,
    always: IntArray,
    old_pos: IntArray,
    old_layer: IntArray,
    units: IntArray,
    load_units: IntArray,
) -> tuple[IntArray, int] | None:
    """The common case vectorised: every unit size equal (queue and loads), and no queue entry that the token needs is
    passed by the pointer before its own layer (passed entries are skipped: already touched). With equal sizes each
    step evicts exactly its shortfall, so after step j the demand is max(0, misses so far - free) and the pointer sits
    at the first queue position whose prefix frees that much. Returns (evicted, free after) or None."""
    sizes = np.concatenate([units[queue], load_units])
    if sizes.size and int(sizes.min()) != int(sizes.max()):
        return None
    demand = np.maximum(np.cumsum(per_layer_miss) - free, 0)
    if int(demand[-1]) > int(c[-1]):
        return None
    pointer = np.searchsorted(c, demand, side="left")  # after each step
    passed_at = np.searchsorted(pointer, old_pos, side="right")  # first step whose pointer lies beyond the entry
    if bool((passed_at < old_layer).any()):
        return None
    end = int(pointer[-1])
    return queue[:end][always[:end] == 1], free - int(per_layer_miss.sum()) + int(demand[-1])
