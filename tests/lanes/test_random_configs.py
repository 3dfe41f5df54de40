"""Token identity on random configurations of every family (slow): shapes no fixture has (odd widths, one KV head,
head dims from 8 to 32, windows), random engine settings, eager and compiled, fp32 and bf16. Each case draws its
model and settings from its seed, so a failure names a case that reruns alone. A one-off run of such cases found
three bugs: a one-KV-head model that did not compile, bf16 experts of width 36 that `torch._grouped_mm` refused,
and the traceback the first of them gave."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import moelane
from tests.helpers import FAMILY_CONFIGS, random_model
from tests.lanes.reference import prompts
from tests.lanes.test_engine_lm import check_identity, params_of

MOE_FAMILIES = [f for f in FAMILY_CONFIGS if f not in ("qwen3", "llama")]
LATENT = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")  # heads and head dims set by their latent attention


def shape_of(family: str, rng: random.Random) -> dict[str, Any]:
    base, out = FAMILY_CONFIGS[family][2], dict[str, Any]()
    out["num_experts_per_tok"] = rng.choice([1, 2, 3]) if family != "phimoe" else 2  # (sparsemixer picks two)
    out["tie_word_embeddings"] = rng.random() < 0.3
    if family in LATENT:
        return out
    heads, kv = rng.choice([(6, 2), (4, 4), (8, 2), (4, 1)])
    out.update(num_attention_heads=heads, num_key_value_heads=kv)
    if "head_dim" in base:
        out.update(head_dim=rng.choice([8, 12, 16, 24, 32]), hidden_size=rng.choice([32, 36, 40, 48, 64]))
    else:
        out["hidden_size"] = heads * rng.choice([4, 6, 8, 12])
    if family == "gpt_oss":
        out["sliding_window"] = rng.choice([4, 6, 12, 64])
    return out


def settings_of(rng: random.Random) -> dict[str, Any]:
    return dict(drafter=rng.choice(["copy", "recall", "model"]), max_streams=rng.randint(1, 7),
                prefill_chunk=rng.choice([3, 5, 8, 64]), guard=rng.random() < 0.5, timed=rng.random() < 0.5,
                max_depth=rng.choice([2, 4, 8]))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_random_shapes_reply_as_solo_decode(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    rng = random.Random(f"{family} {dtype}")
    shape = shape_of(family, rng)
    folder = random_model(family, tmp_path / "target", **shape)
    lm = moelane.load(folder, dtype)
    # drafts from the model itself (they land) or from another random model (they do not)
    draft_folder = folder if rng.random() < 0.5 else random_model(family, tmp_path / "draft", seed=1, **shape)
    draft = moelane.load(draft_folder, dtype)
    cases = [(p, list(lm.generate_ids(p, 16, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    check_identity(lm, draft, cases, 16, **settings_of(rng))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "glm4_moe"])
def test_random_shapes_compiled_reply_as_compiled_solo_decode(family: str, tmp_path: Path) -> None:
    """With one KV head (the shape the compiler once failed on) and otherwise random shapes."""
    rng = random.Random(family)
    shape = {**shape_of(family, rng), "num_attention_heads": 4, "num_key_value_heads": 1}
    folder = random_model(family, tmp_path / "target", **shape)
    lm = moelane.load(folder, compile=True)
    assert lm.warm_up(8, 16)
    cases = [(p, list(lm.generate_ids(p, 16, params_of(i)))) for i, p in enumerate(prompts(6, lm.vocab_size))]
    check_identity(lm, moelane.load(folder), cases, 16, **settings_of(rng))
