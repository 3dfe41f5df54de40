"""Distributed runs on this machine for the tests: every rank a spawned process (torch.multiprocessing's spawn
context), gloo over 127.0.0.1 on a free port; rank 0 runs a job on its model and sends back what it returns."""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from moelane.lanes import Engine, EngineConfig
from moelane.lanes.request import submit_kwargs
from moelane.model.provider import ResidentProvider
from moelane.model.sampling import SamplingParams

Job = Callable[[Any], Any]


@dataclass(frozen=True)
class Rank:
    """One rank's settings: `moelane.dist.load` / `serve_experts` keyword arguments, and a path of its own."""

    settings: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(path: Path | None, job: Job, ranks: list[Rank], timeout_s: float = 30.0, wait_s: float = 240.0) -> Any:
    """Start len(ranks) ranks on `path` (a rank's own path overrides it), run `job(lm)` on rank 0 and return its
    result, or ("error", rank, class name, message) of rank 0 if it raised, else of another rank that did. Every
    rank is ended before this returns."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, world = free_port(), len(ranks)
    procs = [ctx.Process(target=rank_main, args=(r, world, port, rank.path or path, rank.settings, job, timeout_s,
                                                 results), daemon=True) for r, rank in enumerate(ranks)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s
    said: Any = ("error", -1, "Timeout", f"no result within {wait_s} s")
    try:
        while True:  # (rank 0's result; another rank's error only if rank 0 says nothing)
            rank, said = pickle.loads(results.get(timeout=max(0.1, deadline - time.monotonic())))
            if rank == 0:
                return said
    except queue.Empty:
        return said
    finally:
        deadline = time.monotonic() + 10  # (a rank a test hung is killed)
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()


def rank_main(rank: int, world: int, port: int, path: Path | None, settings: dict[str, Any], job: Job,
              timeout_s: float, results: Any) -> None:  # fmt: skip
    import moelane.dist

    torch.set_num_threads(1)
    try:
        ranks = moelane.dist.join(timeout_s, f"tcp://127.0.0.1:{port}", rank, world)
    except Exception as e:
        results.put(pickle.dumps((rank, ("error", rank, type(e).__name__, str(e)))))
        return
    try:
        if rank == 0:
            lm = moelane.dist.load(ranks, path, **settings)
            try:
                # (pickled here: a tensor put as it is goes by a shared file that ends with this process)
                results.put(pickle.dumps((rank, job(lm))))
            finally:
                lm.close()
        else:
            moelane.dist.serve_experts(ranks, path, **settings)
    except Exception as e:
        results.put(pickle.dumps((rank, ("error", rank, type(e).__name__, str(e)))))
    finally:
        ranks.close()


# ---- jobs (module-level: a spawned process imports them by name) ------------------------------------------------


def params_of(i: int) -> SamplingParams:
    return SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9, seed=31 + i)


def replies(lm: Any, prompts: list[list[int]], n_tokens: int, configs: list[dict[str, Any]]) -> list[list[list[int]]]:
    """Each engine config's replies to every prompt (greedy and seeded in turn)."""
    out = []
    for config in configs:
        engine = Engine(lm, EngineConfig(**config))
        streams = [engine.submit(p, n_tokens, **submit_kwargs(params_of(i))) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        out.append([s.token_ids for s in streams])
    return out


class Logits:
    """A job: the logits of each prompt as a fresh sequence."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def __call__(self, lm: Any) -> Any:
        return [lm.logits(p) for p in self.prompts]


class Replies:
    """A job (picklable): the logits of each prompt as a fresh sequence, and `replies`."""

    def __init__(self, prompts: list[list[int]], n_tokens: int, configs: list[dict[str, Any]]) -> None:
        self.args = (prompts, n_tokens, configs)

    def __call__(self, lm: Any) -> Any:
        return [lm.logits(p) for p in self.args[0]], replies(lm, *self.args)


# ---- faults ------------------------------------------------------------------------------------------------------


class Faulty:
    """A provider factory (a rank's own): every expert resident, and at its `after`-th layer call the process
    dies (`how` "die": SIGKILL) or stops answering ("hang")."""

    def __init__(self, after: int, how: str) -> None:
        self.after, self.how = after, how

    def __call__(self, handles: Any, dtype: torch.dtype) -> Any:
        inner = ResidentProvider.from_handles(handles, dtype)
        calls = [0]
        after, how = self.after, self.how

        class Failing:
            def pools(self, layer: int) -> Any:
                return inner.pools(layer)

            def weights(self, layer: int) -> Any:
                return inner.weights(layer)

            def slots(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
                calls[0] += 1
                if calls[0] >= after:
                    if how == "die":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(3600)
                return inner.slots(layer, ids)

        return Failing()


class FailingGenerate:
    """A job: generate from each prompt and say how the run ended, and how long the failing request took."""

    def __init__(self, prompt: list[int], n_tokens: int) -> None:
        self.prompt, self.n_tokens = prompt, n_tokens

    def __call__(self, lm: Any) -> Any:
        engine = Engine(lm, EngineConfig(drafter="none", timed=False))
        start = time.monotonic()
        stream = engine.submit(self.prompt, self.n_tokens)
        engine.run_until_idle()
        first = (stream.finish_reason, type(stream.error).__name__, str(stream.error), time.monotonic() - start)
        start = time.monotonic()
        again = engine.submit(self.prompt, self.n_tokens)  # a later request fails at once
        engine.run_until_idle()
        return first, (again.finish_reason, type(again.error).__name__, time.monotonic() - start)
