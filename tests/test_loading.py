"""`moelane.load`: one call gives a model ready to run, with the expert store its settings ask for attached and its
prefill chunks fitted to the pool; settings that cannot work are refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import moelane
from moelane.model.provider import ResidentProvider
from moelane.pager.live.build import store_factory
from moelane.pager.live.memory import MemorySpec, parse_memory
from moelane.pager.live.store import ExpertStore, StoreError
from tests.helpers import random_model

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 MoE layers x 16 experts, top-2: 10% of the expert bytes is 6 slots, fewer than one layer's experts."""
    return random_model("qwen3_moe", tmp_path_factory.mktemp("m"), seed=3, num_hidden_layers=4, num_experts=16,
                        num_experts_per_tok=2, mlp_only_layers=[])  # fmt: skip


@pytest.mark.parametrize("budget", ["10%", MemorySpec(fraction=0.1)])
def test_a_budget_gives_an_attached_store_and_prefill_chunks_that_fit(folder: Path, budget: str | MemorySpec) -> None:
    want = list(moelane.load(folder).generate_ids(PROMPT, 8))
    lm = moelane.load(folder, expert_memory=budget)
    store = lm.provider
    assert isinstance(store, ExpertStore) and store.n_slots == 6
    assert store.live_planner is not None and store.listeners  # the planner and the predictors hooked
    assert lm.prefill_chunk == store.max_rows(2) == 3
    assert list(lm.generate_ids(PROMPT, 8)) == want
    lm.close()


def test_without_a_budget_experts_that_fit_are_resident(folder: Path) -> None:
    lm = moelane.load(folder)
    assert isinstance(lm.provider, ResidentProvider) and lm.prefill_chunk == 256


def test_a_providers_own_factory_is_used_as_it_comes(folder: Path) -> None:
    lm = moelane.load(folder, provider=store_factory(parse_memory("10%")))
    store = lm.provider
    assert isinstance(store, ExpertStore) and store.live_planner is None and not store.listeners
    assert lm.prefill_chunk == 256
    lm.close()
    with pytest.raises(ValueError, match="not both"):
        moelane.load(folder, provider=store_factory(), expert_memory="10%")


def test_settings_that_cannot_work_are_refused_before_loading(tmp_path: Path) -> None:
    missing = tmp_path / "no model here"
    with pytest.raises(StoreError, match="expert_memory: not a memory size: 'lots'"):
        moelane.load(missing, expert_memory="lots")
    with pytest.raises(StoreError, match="host_memory: memory share must be between 0% and 100%"):
        moelane.load(missing, host_memory="150%")
    with pytest.raises(StoreError, match="policy"):
        moelane.load(missing, policy="fifo")  # (no budget: the fitting rule's store would have used it)
    with pytest.raises(StoreError, match="precision tier"):
        moelane.load(missing, expert_memory="50%", default_tier="int3")
