"""A part the model runs on fails for good (a rank of a distributed run): the request in flight ends with 503 and
the failure's words, /health says "degraded" (503), and later requests get 503 at once."""

from __future__ import annotations

from typing import Any

import httpx

from moelane.errors import Unavailable
from moelane.lanes.config import EngineConfig
from moelane.lanes.engine import Engine
from moelane.server.app import create_app
from tests.server.conftest import MODEL, SlowTarget, running


class BreaksAt(SlowTarget):
    """The model, until a pass holds `token`: from then on every pass raises `error` (as a failed rank does)."""

    def __init__(self, lm: Any, token: int) -> None:
        super().__init__(lm, poison=token)
        self.error, self.broken = Unavailable("rank 1 died (test)"), False

    def forward(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.broken = self.broken or any(self.poison in r.token_ids for r in rows)
        if self.broken:
            raise self.error
        return super().forward(rows, *args, **kwargs)


def test_a_failed_part_gives_503_and_a_degraded_health(tiny_lm: Any) -> None:
    target = BreaksAt(tiny_lm, token=7)
    engine = Engine(target, EngineConfig(drafter="none", timed=False))
    app = create_app(engine, tiny_lm, model_name=MODEL, fault=lambda: target.error if target.broken else None)
    with running(app) as url:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "active_streams": 0, "waiting_streams": 0}
        failed = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [1, 7]}, timeout=30)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "service_unavailable"
        assert "rank 1 died (test)" in failed.json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded" and health.json()["problem"] == "rank 1 died (test)"
        later = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert later.status_code == 503 and "the server is degraded: rank 1 died (test)" in later.text
