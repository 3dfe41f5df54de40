"""Background fetching and the two predictors that issue early loads, hooked into a live model (docs/design.md,
"Prediction and prefetch").

- `FetchPool`: I/O threads serving a priority queue: a pass's own misses (priority 0) before prefetches (1).
- `LookAhead`: applies layer L+1's router to the input of layer L's MoE block (as mixtral-offloading does) and
  prefetches what it predicts while layer L computes. It runs only on passes of at most `max_rows` rows (decode).
- `CooccurrencePredictor`: per layer, counts transitions from one token's experts to the next token's (per thread,
  i.e. per stream), and after each layer call predicts the next token's experts of that layer by noisy-OR,
  P(e) = 1 - prod_p (1 - n(p -> e) / n(p)), taking those with P >= threshold as candidates. Its counting and
  predicting run on its own thread: the pass only enqueues the routed ids (no policy work on the per-token path).
- Cost-aware: each predictor turns a candidate's score (the router's weight; the noisy-OR P) into the probability of
  use it has measured for such scores (`Calibration`), and loads it only where that beats the store's
  `prefetch_threshold` (price.py: the disk time of a read against the compute it can hide behind, and the share of
  the source's loads that passes actually used).
- `attach(lm, store)` installs both plus a post-block hook that releases the thread's slot lease as soon as a MoE
  block has computed.

Each predictor scores itself against the routing it predicted (`PrefetchCounts.correct / routed` is its recall);
the store counts the loads it issued, used and wasted.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from moelane.model.provider import RoutingRecord, host_side
from moelane.pager.plan import Plan
from moelane.pager.planner import Planner, PlannerConfig
from moelane.pager.price import Calibration
from moelane.pager.trace import Segment

log = logging.getLogger(__name__)


class RoutingListener(Protocol):
    def routed(self, layer_index: int, keys: list[int]) -> None:
        """A `slots` call routed these flat expert keys (layer index * E + expert) on the calling thread."""
        ...


class PrefetchTarget(Protocol):
    layers: list[int]
    n_experts: int
    listeners: list[RoutingListener]

    live_planner: LivePlanner | None

    def prefetch(self, layer: int, experts: list[int], source: str, ahead: int = 0, p: float | None = None) -> int: ...
    def prefetch_threshold(self, ahead: int, source: str | None = None) -> float: ...
    def apply(self, plan: Plan) -> None: ...
    def planner_config(self, top_k: int, **overrides: Any) -> PlannerConfig: ...
    def prefetch_keys(self, keys: list[int], source: str, ahead: int = 0, p: float | None = None) -> int: ...
    def count_prediction(self, source: str, predicted: int, correct: int, routed: int) -> None: ...
    def release(self) -> None: ...


class FetchPool:
    """`n_threads` daemon threads running jobs by priority, then submission order. With 0 threads jobs run inline."""

    def __init__(self, n_threads: int) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._work, name=f"moelane-fetch-{i}", daemon=True) for i in range(n_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, job: Callable[[], None]) -> None:
        if not self._threads:
            job()
            return
        self._queue.put((priority, next(self._seq), job))

    def _work(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # jobs report their own failures through futures; this is a bug guard
                log.exception("expert fetch job failed")

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put((1 << 30, next(self._seq), None))
        for t in self._threads:
            t.join(timeout=5)


Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # a MoE block's `route`: x -> (weights, ids)


class LookAhead:
    """Predicts layer L+1's experts from layer L's block input; `gates[L] = (next layer, its router)`."""

    def __init__(self, store: PrefetchTarget, gates: dict[int, tuple[int, Router]], max_rows: int = 4):
        self.store, self.gates, self.max_rows = store, gates, max_rows
        self._index = {layer: i for i, layer in enumerate(store.layers)}
        self._predicted: dict[tuple[int, int], dict[int, float]] = {}  # key -> its score (router weight)
        self.calibration = Calibration()

    def before_block(self, layer: int, x: torch.Tensor) -> None:
        if layer not in self.gates or x.shape[0] > self.max_rows:
            return
        nxt, route = self.gates[layer]
        weights, ids = route(x)  # [T, K] each
        scores: dict[int, float] = {}
        for e, w in zip(ids.reshape(-1).tolist(), weights.reshape(-1).float().tolist(), strict=True):
            scores[e] = max(w, scores.get(e, 0.0))
        base = self._index[nxt] * self.store.n_experts
        self._predicted[(threading.get_ident(), self._index[nxt])] = {base + e: w for e, w in scores.items()}
        least = self.store.prefetch_threshold(0, "lookahead")
        odds = {e: p for e, w in scores.items() if (p := self.calibration.p(w)) >= least}
        if odds:
            self.store.prefetch(nxt, sorted(odds), "lookahead", 0, sum(odds.values()) / len(odds))

    def routed(self, layer_index: int, keys: list[int]) -> None:
        predicted = self._predicted.pop((threading.get_ident(), layer_index), None)
        if predicted is not None:
            used = set(keys)
            for key, score in predicted.items():
                self.calibration.add(score, key in used)
            self.store.count_prediction("lookahead", len(predicted), len(used.intersection(predicted)), len(keys))


class CooccurrencePredictor:
    """Noisy-OR over observed token-to-token transitions, per layer and per thread (stream)."""

    def __init__(self, store: PrefetchTarget, threshold: float = 0.3, max_predict: int = 8) -> None:
        if not 0.0 < threshold <= 1.0 or max_predict < 1:
            raise ValueError(f"bad co-occurrence predictor settings: threshold {threshold}, max {max_predict}")
        self.store, self.threshold, self.max_predict = store, threshold, max_predict
        n_layers, n_experts = len(store.layers), store.n_experts
        self._pairs = np.zeros((n_layers, n_experts, n_experts), np.float32)
        self._seen = np.zeros((n_layers, n_experts), np.float32)
        self._prev: dict[tuple[int, int], np.ndarray] = {}
        self._predicted: dict[tuple[int, int], dict[int, float]] = {}  # key -> its noisy-OR P
        self.calibration = Calibration()
        self._queue: queue.SimpleQueue[tuple[int, int, list[int]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="moelane-cooc", daemon=True)
        self._thread.start()

    def routed(self, layer_index: int, keys: list[int]) -> None:
        self._queue.put((threading.get_ident(), layer_index, keys))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.step(*item)
            except Exception:
                log.exception("co-occurrence predictor step failed")

    def step(self, ident: int, li: int, keys: list[int]) -> None:
        base = li * self.store.n_experts
        experts = np.asarray(keys, np.int64) - base
        predicted = self._predicted.pop((ident, li), None)
        if predicted is not None:
            used = set(keys)
            for key, score in predicted.items():
                self.calibration.add(score, key in used)
            self.store.count_prediction("cooc", len(predicted), len(used.intersection(predicted)), len(keys))
        prev = self._prev.get((ident, li))
        if prev is not None:
            self._pairs[li][np.ix_(prev, experts)] += 1.0
            self._seen[li, prev] += 1.0
        self._prev[(ident, li)] = experts
        seen = self._seen[li, experts]
        if not seen.any():
            return
        rates = self._pairs[li][experts] / np.maximum(seen, 1.0)[:, None]  # [n_prev, E]
        p = 1.0 - np.prod(1.0 - rates, axis=0)
        ranked = np.argsort(-p, kind="stable")[: self.max_predict]
        candidates = {int(e) + base: float(p[e]) for e in ranked if p[e] >= self.threshold}
        self._predicted[(ident, li)] = candidates
        least = self.store.prefetch_threshold(1, "cooc")
        odds = {key: p for key, score in candidates.items() if (p := self.calibration.p(score)) >= least}
        if odds:
            self.store.prefetch_keys(list(odds), "cooc", 1, sum(odds.values()) / len(odds))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class LivePlanner:
    """The planner (`moelane.pager.planner`) driven live: routing records in, on its own thread; each published plan
    applied to the store. The engine's phase labels mark the boundary (`begin_decode`, called by the store at the first
    decode pass of a thread); unlabelled records fall back to the planner's size-based detector."""

    def __init__(self, store: PrefetchTarget, **overrides: Any) -> None:
        self.store, self.overrides = store, overrides
        self.planner: Planner | None = None
        self.n_segments, self.n_plans = 0, 0
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="moelane-planner", daemon=True)
        self._thread.start()

    def observe(self, record: RoutingRecord) -> None:
        ids = record.expert_ids.permute(1, 0, 2).numpy().copy()  # [L, T, K] -> [T, L, K]
        self._queue.put(("segment", (ids, record.phase, np.asarray(record.stream_ids or [0] * ids.shape[0]))))

    def begin_decode(self) -> None:
        self._queue.put(("boundary", None))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._step(*item)
            except Exception:
                log.exception("live planner step failed")

    def _step(self, kind: str, body: Any) -> None:
        if kind == "flush":
            body.set()
            return
        if kind == "segment":
            ids, phase, streams = body
            if self.planner is None:
                self.planner = Planner(self.store.planner_config(top_k=ids.shape[2], **self.overrides))
            plan = self.planner.observe(Segment(self.n_segments, phase, ids, streams))
            self.n_segments += 1
        else:
            plan = self.planner.begin_decode() if self.planner is not None else None
        if plan is not None:
            self.n_plans += 1
            self.store.apply(plan)

    def wait(self) -> None:
        """Block until everything queued so far is processed (tests, benchmarks)."""
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait(timeout=60)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


@dataclass(slots=True)
class Attachment:
    """What `attach` installed; `detach()` removes it."""

    hooks: list[Any] = field(default_factory=list)
    listeners: list[RoutingListener] = field(default_factory=list)
    store: PrefetchTarget | None = None
    lm: Any = None
    planner: LivePlanner | None = None

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()
        if self.planner is not None:
            self.lm.observers.remove(self.planner)
            self.planner.close()
            if self.store is not None:
                self.store.live_planner = None
            self.planner = None
        if self.store is not None:
            for listener in self.listeners:
                self.store.listeners.remove(listener)
                if isinstance(listener, CooccurrencePredictor):
                    listener.close()
        self.hooks.clear()
        self.listeners.clear()


def next_gates(lm: Any, layers: list[int]) -> dict[int, tuple[int, Router]]:
    """Per MoE layer, the next MoE layer's (index, router): its block's own `route`, so a prediction chooses as that
    layer will (softmax or sigmoid scores, router and score biases, expert groups), only from an earlier input."""
    gates = {}
    for layer, nxt in itertools.pairwise(layers):
        route = getattr(lm.model.model.layers[nxt].mlp, "route", None)
        if callable(route):
            gates[layer] = (nxt, route)
    return gates


def attach(
    lm: Any, store: PrefetchTarget, lookahead: bool = True, cooc: bool = True, planner: bool = False
) -> Attachment:
    """Hook a loaded LM's MoE blocks to the store: lease release after each block, the predictors, and (`planner`)
    the live planner as a routing observer. With the LM's decode step compiled (enable it first), the hooks run as
    plain Python inside it."""
    blocks = {layer: lm.model.model.layers[layer].mlp for layer in store.layers}
    out = Attachment(store=store, lm=lm)
    if planner:
        out.planner = store.live_planner = LivePlanner(store)
        lm.observers.append(out.planner)
    hook: Callable[[Callable[..., None]], Callable[..., None]] = host_side if lm.compile_enabled else lambda f: f
    release = hook(lambda module, args, output: store.release())
    for block in blocks.values():
        out.hooks.append(block.register_forward_hook(release))
    if lookahead:
        gates = next_gates(lm, store.layers)
        ahead = LookAhead(store, gates)
        before = hook(ahead.before_block)
        for layer in gates:
            out.hooks.append(
                blocks[layer].register_forward_pre_hook(lambda m, args, layer=layer: before(layer, args[0]))
            )
        out.listeners.append(ahead)
    if cooc:
        out.listeners.append(CooccurrencePredictor(store))
    store.listeners.extend(out.listeners)
    return out
