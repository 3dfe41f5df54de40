"""Eight generations at once through one store holding 10% of the expert bytes: the budget holds (instrumented
high-water mark), nothing deadlocks, and every reply equals its single-stream all-resident reply."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import moelane
import moelane.pager.live.store as store_module
from moelane.pager.live.build import store_factory
from moelane.pager.live.memory import parse_memory
from moelane.pager.live.store import ExpertStore
from tests.helpers import random_model

N_STREAMS = 8


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 MoE layers x 16 experts, top-2: 10% of expert bytes (19 slots) still holds one layer's experts."""
    return random_model(
        "qwen3_moe", tmp_path_factory.mktemp("deep"), seed=2,
        num_hidden_layers=12, num_experts=16, num_experts_per_tok=2, mlp_only_layers=[],
    )  # fmt: skip


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 290 + 3 for j in range(6 + i)] for i in range(N_STREAMS)]


@pytest.mark.parametrize(
    ("predictors", "staged"),
    [
        pytest.param(False, False, marks=pytest.mark.slow),
        (True, False),
        pytest.param(True, True, marks=pytest.mark.slow),  # (~4 s)
    ],
)
def test_eight_streams_at_ten_percent(
    deep: Path, predictors: bool, staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`staged`: misses load on the I/O threads while the resident experts compute (what experts of >= 1 MiB do)."""
    if staged:
        monkeypatch.setattr(store_module, "SMALL_EXPERT_BYTES", 0)
    resident = moelane.load(deep)
    want = [list(resident.generate_ids(p, 10)) for p in prompts()]
    lm = moelane.load(deep, provider=store_factory(parse_memory("10%"), None, "planner", "native"))
    store = lm.provider
    assert isinstance(store, ExpertStore)
    assert store.n_slots == int(0.1 * store.total_bytes) // store.slot_bytes < 2 * store.n_experts
    attached = store.attach(lm, lookahead=predictors, cooc=predictors)
    got: list[list[int] | None] = [None] * N_STREAMS
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = list(lm.generate_ids(prompts()[i], 10, prefill_chunk=4))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "deadlock: a generation did not finish"
    assert not errors, errors
    store.wait_loads()
    attached.detach()
    assert got == want
    assert 0 < store.high_water_bytes <= store.config.budget_bytes
    (pool,) = store.pools(store.layers[0])  # native only: one pool of exactly the slots the budget holds
    assert pool.kind == "native" and pool.n_slots == store.n_slots
    assert pool.w13[0].nbytes + pool.w2[0].nbytes <= store.config.budget_bytes
    store.check_invariants()
    assert store.stats.evictions > 0
    if predictors:
        assert store.stats.source("lookahead").routed > 0 and store.stats.source("cooc").routed > 0
    store.close()
