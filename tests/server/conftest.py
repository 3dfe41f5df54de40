"""Fixtures for the server tests: a tiny random qwen3_moe (built once per session), lanes engines over it, and a
uvicorn server on a free loopback port in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn

import moelane
from moelane.lanes.config import EngineConfig
from moelane.lanes.engine import Engine
from moelane.server.app import create_app
from tests.helpers import random_model

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder: Path = random_model("qwen3_moe", tmp_path_factory.mktemp("server-q3"))
    return moelane.load(folder)


class SlowTarget:
    """The model, slowed down by `delay` seconds a pass, failing any pass that holds the `poison` token id."""

    def __init__(self, lm: Any, delay: float = 0.0, poison: int | None = None) -> None:
        self.lm, self.delay, self.poison = lm, delay, poison
        self.error: Exception = RuntimeError("poisoned pass (test)")  # what a poisoned pass raises
        self.vocab_size, self.eos_ids, self.max_context = lm.vocab_size, lm.eos_ids, lm.max_context

    def new_cache(self, capacity: int) -> Any:
        return self.lm.new_cache(capacity)

    def cache_for(self, n_prompt: int, max_tokens: int) -> Any:
        return self.lm.cache_for(n_prompt, max_tokens)

    def forward(self, rows: list[Any], *args: Any, **kwargs: Any) -> Any:
        if self.poison is not None and any(self.poison in r.token_ids for r in rows):
            raise self.error
        if self.delay:
            time.sleep(self.delay)
        return self.lm.forward(rows, *args, **kwargs)


def make_engine(lm: Any, delay: float = 0.0, poison: int | None = None, **config: Any) -> Engine:
    target = SlowTarget(lm, delay, poison) if delay or poison is not None else lm
    return Engine(target, EngineConfig(**{"drafter": "none", "timed": False, "max_streams": 16, **config}))


def wait_until(cond: Any, timeout: float = 10.0) -> bool:
    """Poll `cond` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


@contextmanager
def running(app: Any) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port in a thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture
def serve(tiny_lm: Any) -> Iterator[Callable[..., tuple[str, Engine]]]:
    """serve(delay=..., poison=..., max_queue=..., **engine config) -> (base URL, engine); stopped after the test."""
    stack: list[Any] = []

    def start(delay: float = 0.0, poison: int | None = None, max_queue: int = 64, limits: Any = None,
              **config: Any) -> tuple[str, Engine]:  # fmt: skip
        engine = make_engine(tiny_lm, delay, poison, **config)
        app = create_app(engine, tiny_lm, model_name=MODEL, max_queue=max_queue, limits=limits)
        ctx = running(app)
        url = ctx.__enter__()
        stack.append(ctx)
        return url, engine

    yield start
    for ctx in reversed(stack):
        ctx.__exit__(None, None, None)
