"""A rank that dies or hangs mid-request fails that request on rank 0 within the timeout, with a clear error, and
every later one at once; a rank started with another model or other settings is refused at rendezvous, on every
rank, with a message that names the difference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.helpers import FailingGenerate, Faulty, Logits, Rank, launch
from tests.helpers import random_model

TIMEOUT_S = 4.0


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_rank_lost_mid_request_fails_it_within_the_timeout(tiny: Path, how: str) -> None:
    # (the tiny model has 2 MoE layers: rank 1 fails at its 5th call, in the 3rd pass, after the prompt's)
    got = launch(tiny, FailingGenerate([1, 5, 9, 13, 2], 12), [Rank(), Rank({"provider": Faulty(5, how)})], TIMEOUT_S)
    (reason, kind, message, seconds), (again, again_kind, again_seconds) = got
    assert (reason, kind) == ("error", "RankFailure"), got
    assert "died or did not answer within the 4 s of --dist-timeout" in message
    assert seconds < TIMEOUT_S + 8 and (how == "die" or seconds >= TIMEOUT_S)
    assert (again, again_kind) == ("error", "RankFailure") and again_seconds < 1.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_experts": 12}, "config.n_experts is 12 there, 10 on rank 0"),
        ({"seed": 1}, "first expert is"),
    ],
)
def test_a_rank_with_another_model_is_refused(tiny: Path, change: dict[str, int], named: str) -> None:
    other = random_model("qwen3_moe", tiny.parent / f"other-{'-'.join(map(str, change.values()))}", **change)
    got = launch(tiny, Logits([[1, 2]]), [Rank(), Rank(path=other)])
    assert got[:3] == ("error", 0, "RankMismatch") and named in got[3], got
    assert got[3].startswith("rank 1 was started with a different model or settings")


@pytest.mark.slow
def test_a_rank_computing_in_another_dtype_is_refused(tiny: Path) -> None:
    got = launch(tiny, Logits([[1, 2]]), [Rank(), Rank({"dtype": torch.bfloat16})])
    assert got[:3] == ("error", 0, "RankMismatch") and "compute dtype is bfloat16 there, float32 on rank 0" in got[3]
