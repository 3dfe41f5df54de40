"""Each rank's counters reach rank 0: `/metrics` has a line per rank of each rank metric, and `--stats` (the spread
provider's `describe`) a line per rank; rank 1 pages half its share, so it misses and reads from disk, rank 0 holds
its share resident and never misses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx

from moelane.lanes import Engine, EngineConfig
from moelane.server.app import create_app
from tests.distributed.helpers import Rank, launch
from tests.server.conftest import running


class ServedMetrics:
    """A job: serve one completion, then read /metrics and the run's --stats text."""

    def __call__(self, lm: Any) -> Any:
        engine = Engine(lm, EngineConfig(drafter="none", timed=False))
        app = create_app(engine, lm, model_name="tiny")
        with running(app) as url:
            body = {"model": "tiny", "prompt": [1, 5, 9, 13, 2, 7], "max_tokens": 6, "temperature": 0}
            status = httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
            metrics = httpx.get(f"{url}/metrics", timeout=60).text
        return status, metrics, lm.provider.describe()


def sample(text: str, name: str, rank: int) -> float:
    found = re.search(rf'^{name}{{rank="{rank}"}} (\S+)$', text, re.M)
    assert found is not None, f"{name} of rank {rank}"
    return float(found.group(1))


def test_metrics_and_stats_have_a_line_per_rank(tiny: Path) -> None:
    got = launch(tiny, ServedMetrics(), [Rank(), Rank({"expert_memory": "50%"})])
    assert not (isinstance(got, tuple) and got[0] == "error"), got
    status, metrics, stats = got
    assert status == 200
    for rank in (0, 1):
        assert sample(metrics, "moelane_rank_experts", rank) == 10  # 5 a layer, 2 MoE layers
        assert sample(metrics, "moelane_rank_pairs_total", rank) > 0
        assert sample(metrics, "moelane_rank_expert_hits_total", rank) > 0
        assert sample(metrics, "moelane_rank_exchange_seconds_total", rank) > 0
        assert sample(metrics, "moelane_rank_cpu_user_seconds_total", rank) > 0
    assert sample(metrics, "moelane_rank_expert_misses_total", 0) == 0
    assert sample(metrics, "moelane_rank_experts_resident", 1) < 10
    assert sample(metrics, "moelane_rank_expert_misses_total", 1) > 0
    assert sample(metrics, "moelane_rank_paged_bytes_total", 1) > 0
    lines = stats.splitlines()
    assert lines[0] == "experts over 2 ranks (rank 0 [0, 5), rank 1 [5, 10) of 10 a layer)"
    assert lines[2].startswith("  rank 0: 10 experts, 10 in memory at once;") and "none paged" in lines[2]
    assert lines[3].startswith("  rank 1: 10 experts, ") and "MiB paged in" in lines[3]
