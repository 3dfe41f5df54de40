"""The store under every MoE family: greedy tokens at half the expert bytes equal the all-resident run."""

from __future__ import annotations

from pathlib import Path

import pytest

import moelane
from moelane.pager.store import ExpertStore, store_factory
from tests.helpers import random_model

MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_family_pages_with_identical_tokens(family: str, tmp_path: Path) -> None:
    folder = random_model(family, tmp_path / family)
    prompt = list(range(3, 30))
    want = list(moelane.load(folder).generate_ids(prompt, 12))
    lm = moelane.load(folder, provider=store_factory("50%", None, "planner", "native"))
    store = lm.provider
    assert isinstance(store, ExpertStore)
    attached = store.attach(lm)
    chunk = min(256, store.max_rows(lm.args.num_experts_per_tok))
    assert list(lm.generate_ids(prompt, 12, prefill_chunk=chunk)) == want
    attached.detach()
    store.check_invariants()
    assert store.stats.totals().misses > 0
    store.close()
