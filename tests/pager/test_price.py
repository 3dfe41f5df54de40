"""Cost-aware prefetch: the least probability of use at which a load pays (price.py), predictors' calibration, and
the store dropping queued prefetches that went stale and running those a pass claims as its own misses."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import moelane
from moelane.pager.live.store import ExpertStore, StoreConfig
from moelane.pager.price import Calibration, LoadPrice, least_probability
from tests.helpers import random_model


def test_the_threshold_weighs_disk_time_against_the_compute_it_hides_behind() -> None:
    price = LoadPrice(n_layers=6)
    assert price.threshold(0) == price.threshold(1) == 0.0  # (nothing measured: every prediction loads)
    price.observe_read(0.020, concurrent=2)  # 10 ms of disk a read
    price.observe_layer(0.002)
    price.observe_pass(0.010)  # the disk was busy the whole pass
    assert price.threshold(0) == pytest.approx(0.010 / (0.010 + 0.002))  # one layer hides 2 ms of a 10 ms read
    assert price.threshold(1) == pytest.approx(0.5)  # a whole pass hides all of it: pays above even odds
    idle = LoadPrice(n_layers=6)
    idle.observe_read(0.0001, concurrent=1)
    idle.observe_layer(0.002)
    idle.observe_pass(0.100)  # the disk busy 0.1% of the time: a wasted load costs almost nothing
    assert idle.threshold(0) < 0.01


MEASURED = [(0.010, 0.002, 1.0), (0.0002, 0.0006, 0.3), (0.007, 0.004, 0.8)]  # read_s, layer_s, busy


@pytest.mark.parametrize(("read_s", "layer_s", "busy"), MEASURED)
def test_the_store_prices_a_load_by_the_same_rule_as_the_replay(read_s: float, layer_s: float, busy: float) -> None:
    """One function decides for both (`least_probability`); the store only measures its inputs."""
    price = LoadPrice(n_layers=6)
    price.observe_read(read_s, concurrent=1)
    price.observe_layer(layer_s)
    price.observe_pass(read_s / busy)
    assert price.threshold(0) == pytest.approx(least_probability(read_s, layer_s, busy))
    assert price.threshold(1) == pytest.approx(least_probability(read_s, 6 * layer_s, busy))
    r, h, u = read_s, layer_s, busy
    assert least_probability(r, h, u) == pytest.approx(r * u / (r * u + min(h, r)))  # docs: p > r*u / (r*u + min(h, r))
    assert least_probability(r, h, 0.0) == 0.0


def test_a_source_whose_loads_go_unused_must_be_surer_and_tries_again_later() -> None:
    """Right predictions evicted before their token comes (a pool barely over one token's experts) are waste too."""
    price = LoadPrice(n_layers=6)
    price.observe_read(0.010, concurrent=1)
    price.observe_layer(0.002)
    price.observe_pass(0.010)
    base = price.threshold(1)
    for _ in range(50):
        price.observe_issue("cooc", 0.8)
        price.observe_outcome("cooc", False)
    assert price.threshold(1, "cooc") > 1.0 > base == price.threshold(1, "lookahead")
    for _ in range(300):  # passes without its loads (the disk as busy): its yield drifts back to what it predicts
        price.observe_read(0.010, concurrent=1)
        price.observe_pass(0.010)
    assert price.threshold(1, "cooc") == pytest.approx(base, rel=0.1)


def test_calibration_trusts_the_score_until_it_has_seen_how_such_scores_fare() -> None:
    c = Calibration()
    assert c.p(0.7) == pytest.approx(0.7)
    for _ in range(100):
        c.add(0.72, False)
    assert c.p(0.7) < 0.05 and c.p(0.9) == pytest.approx(0.9)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> moelane.LM:
    folder: Path = random_model("qwen3_moe", tmp_path_factory.mktemp("price"), seed=2, num_hidden_layers=3,
                                num_experts=16, num_experts_per_tok=2, mlp_only_layers=[])  # fmt: skip
    return moelane.load(folder)


def blocked_store(lm: moelane.LM) -> tuple[ExpertStore, threading.Event]:
    """A store with one I/O thread, held busy until the event is set (prefetches queue behind it)."""
    hidden, width = lm.expert_handles[lm.moe_layers[0]][0].tensors["down"].shape
    store = ExpertStore(lm.expert_handles, lm.dtype, StoreConfig(8 * 3 * hidden * width * 4, io_threads=1))
    gate = threading.Event()
    store._pool.submit(0, gate.wait)
    return store, gate


def test_a_queued_prefetch_the_pass_went_by_without_is_dropped_unread(lm: moelane.LM) -> None:
    store, gate = blocked_store(lm)
    first = lm.moe_layers[0]
    try:
        assert store.prefetch(first, [5], "test") == 1
        store.slots(first, torch.tensor([[1, 2]]))  # the pass routes the layer without expert 5
        store.release()
        gate.set()
        store.wait_loads()
        counts = store.stats.source("test")
        assert (counts.dropped, counts.used, store.table.slot_of[5]) == (1, 0, -1)
        assert store.stats.bytes_read[("disk", "native")] == 2 * lm.expert_handles[first][0].nbytes
        store.check_invariants()
    finally:
        gate.set()
        store.close()


def test_a_pass_that_wants_a_queued_prefetch_loads_it_itself(lm: moelane.LM) -> None:
    store, gate = blocked_store(lm)
    layer = lm.moe_layers[1]
    try:
        store.prefetch(layer, [7], "test")
        slots = store.slots(layer, torch.tensor([[7, 3]]))  # (returns while the I/O thread is still held)
        w13, _ = store.weights(layer)
        assert torch.equal(w13[int(slots[0, 0])], lm.provider.weights(layer)[0][7])
        store.release()
        counts, decode = store.stats.source("test"), store.stats.phase("decode")
        assert (counts.late, counts.used, decode.misses, decode.prefetch_hits) == (1, 0, 2, 0)
        gate.set()
        store.wait_loads()
        store.check_invariants()
    finally:
        gate.set()
        store.close()
