"""The store under every MoE family: greedy tokens at half the expert bytes equal the all-resident run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import check_pages_as_resident, random_model

MOE_FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "lfm2_moe",
]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_family_pages_with_identical_tokens(family: str, tmp_path: Path) -> None:
    check_pages_as_resident(random_model(family, tmp_path / family), list(range(3, 30)))
