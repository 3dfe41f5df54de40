"""KV pools: slots survive growth, are zeroed as far as passes read them, and a pool's memory goes back once its
streams are gone."""

from __future__ import annotations

import gc

import torch

from moelane.model.cache import FIRST_SLOTS, KVCache, KVPool

SHAPES = {0: (2, 4, 4), 1: (2, 4, 4)}  # two attention layers: 2 kv heads, key and value dims 4


def test_taken_slots_keep_their_contents_while_the_pool_grows() -> None:
    pool = KVPool(SHAPES, capacity=16, dtype=torch.float32)
    caches = []
    for i in range(9):  # grows 3 -> 7 -> 15
        cache = KVCache(pool)
        pool.prepare(cache.slot, 8)  # as a pass reading 8 positions does first
        for layer in SHAPES:
            cache.write(layer, torch.tensor([0, 5]), torch.full((2, 2, 4), float(i)), torch.full((2, 2, 4), -float(i)))
        caches.append(cache)
    assert pool.n_slots == 15 and pool.n_taken == 9
    for i, cache in enumerate(caches):
        for layer in SHAPES:
            k, v = pool.k[layer][cache.slot], pool.v[layer][cache.slot]
            assert torch.equal(k[:, [0, 5]], torch.full((2, 2, 4), float(i)))
            assert torch.equal(v[:, [0, 5]], torch.full((2, 2, 4), -float(i)))
            assert k[:, 1:5].abs().sum() == 0 and k[:, 6:8].abs().sum() == 0  # never written: zeroed as prepared


def test_a_given_back_slot_is_zeroed_again_as_far_as_it_is_read() -> None:
    pool = KVPool(SHAPES, capacity=16, dtype=torch.float32)
    keep = KVCache(pool)  # keeps the pool in use, so the slot below is reused rather than the pool reset
    cache = KVCache(pool)
    slot = cache.slot
    pool.prepare(slot, 16)
    cache.write(0, torch.tensor([3, 12]), torch.full((2, 2, 4), float("nan")), torch.full((2, 2, 4), float("nan")))
    del cache
    gc.collect()
    again = KVCache(pool)
    assert again.slot == slot and keep.slot != slot
    pool.prepare(slot, 8)  # zeroes what a pass reaching 8 positions reads, and only that
    assert pool.k[0][slot][:, :8].abs().sum() == 0 and torch.isnan(pool.k[0][slot][:, 12]).all()
    pool.prepare(slot, 16)
    assert pool.k[0][slot].abs().sum() == 0


def test_a_pool_returns_to_its_first_size_once_every_cache_is_gone() -> None:
    pool = KVPool(SHAPES, capacity=16, dtype=torch.float32)
    caches = [KVCache(pool) for _ in range(20)]
    assert pool.n_slots == 31
    del caches[1:]
    gc.collect()
    assert pool.n_slots == 31  # a cache is still alive: its slot must not move
    caches.clear()
    gc.collect()
    assert pool.n_slots == FIRST_SLOTS and pool.n_taken == 0
    cache = KVCache(pool)  # and it still serves
    pool.prepare(cache.slot, 4)
    cache.write(1, torch.tensor([2]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    assert pool.k[1][cache.slot][:, 2].sum() == 8
