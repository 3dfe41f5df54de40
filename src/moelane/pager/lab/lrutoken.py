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
