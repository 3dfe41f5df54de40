"""What `GET /v1/stats` answers (the schema is stats.py's `StatsResponse`): samples of counters the engine and the
expert store already keep, taken on the server's side when the endpoint is asked and at most once per `interval_s`,
and the last requests that finished (`RequestLog`, filled by the app as each request ends).

A sample differences the cumulative counters with the previous sample's, so each point of `series` is a rate over
the interval between the two. Every call within an interval gets the same bytes, however many pages watch.

Invariants: nothing here runs unless /v1/stats is asked, so a server nobody watches does no sampling work at all, and
nothing is added on the per-token path; the series and the request log are bounded (`max_samples`, the log's size).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moelane.server.views import PHASES, finite, lanes_view, pager_view, pass_phases

INTERVAL_S = 1.0
MAX_SAMPLES = 600  # ten minutes of samples at one a second
GAP_FACTOR = 3.0  # an interval this many times `interval_s` or longer is a gap: nobody watched, nothing to draw
REQUEST_LOG = 50
TEXT_TOKENS, TEXT_CHARS = 256, 200  # of a prompt decoded, and shown, with --dashboard-show-text

RATE_FIELDS = ("hit_rate_decode", "hit_rate_prefill", "stall_ms_per_token", "tok_s", "rounds_s", "rows_per_round",
               "active", "waiting", "acceptance", "serving_decay", "plan_version")  # fmt: skip


class RequestLog:
    """The last `size` finished requests, newest first (the app adds on the event loop; samples read elsewhere)."""

    def __init__(self, size: int = REQUEST_LOG) -> None:
        self._rows: deque[dict[str, Any]] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._rows.appendleft(row)

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows)


def prompt_text(tokenizer: Any, prompt_ids: tuple[int, ...]) -> str:
    """The first characters of a prompt, for the request log (only with --dashboard-show-text)."""
    return str(tokenizer.decode(list(prompt_ids[:TEXT_TOKENS])))[:TEXT_CHARS]


def request_row(request_id: str, chat: bool, gens: list[Any], started: float, n_prompt: int, cost: Any,
                text: str | None) -> dict[str, Any]:  # fmt: skip
    """The log's entry of a request that just finished (`started`: monotonic seconds; `gens`: its choices'
    generations; `cost`: their pager cost together, a `PagerCost`)."""
    now = time.monotonic()
    firsts = [gen.first_token_at for gen in gens if gen.first_token_at is not None]
    first = min(firsts) if firsts else None
    n_tokens = sum(gen.n_tokens for gen in gens)
    return {"id": request_id, "endpoint": "chat" if chat else "completions", "finished": time.time(),
            "choices": len(gens), "prompt_tokens": n_prompt, "completion_tokens": n_tokens,
            "ttft_s": None if first is None else first - started,
            "tok_s": None if first is None else ratio(n_tokens - len(firsts), now - first),
            "finish_reason": gens[0].finish_reason, "experts_paged": cost.experts_fetched,
            "bytes_paged": cost.bytes_fetched, "stall_s": cost.stall_ms / 1000, "prompt_text": text}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative counters at one moment."""

    at: float  # monotonic seconds
    committed: int
    rounds: int
    rows: int  # rows fed: prompt rows + held drafts + (committed - accepted), one per decoding window
    holds: int
    accepted: int
    prefill_tokens: int
    found: dict[str, int]  # phase -> accesses found resident (hits + prefetch hits)
    accesses: dict[str, int]
    stall_s: float
    reads: dict[str, int]  # "level/tier" -> bytes


def counters(at: float, s: Any, pager: dict[str, Any] | None) -> Counters:
    """`s`: `Engine.stats()`; `pager`: the store's counters (`pager_stats()`), None without a store."""
    phases = pass_phases(pager)
    rows = s.prefill_tokens + s.holds + s.committed - s.accepted
    return Counters(at, s.committed, s.rounds, rows, s.holds, s.accepted, s.prefill_tokens,
                    {p: c["found"] for p, c in phases.items()}, {p: c["accesses"] for p, c in phases.items()},
                    sum(c["stall_s"] for c in phases.values()),
                    {k: int(v) for k, v in (pager or {}).get("bytes_read", {}).items()})  # fmt: skip


def ratio(num: float, den: float) -> float | None:
    return finite(num / den) if den else None


def point(a: Counters, b: Counters, s: Any, pager: dict[str, Any] | None, interval_s: float) -> dict[str, Any]:
    """The series' entry for the interval from sample `a` to sample `b` (`s`, `pager`: the state at `b`)."""
    dt = b.at - a.at
    if dt >= GAP_FACTOR * interval_s or dt <= 0:
        return {"prefill": False, "read_rate": {}, **dict.fromkeys(RATE_FIELDS)}
    plan, bandit = (pager or {}).get("plan"), (pager or {}).get("bandit")
    return {
        **{f"hit_rate_{phase}": ratio(b.found[phase] - a.found[phase], b.accesses[phase] - a.accesses[phase])
           for phase in PHASES},
        "stall_ms_per_token": ratio(1000 * (b.stall_s - a.stall_s), b.committed - a.committed),
        "read_rate": {k: (n - a.reads.get(k, 0)) / dt for k, n in b.reads.items()},
        "tok_s": (b.committed - a.committed) / dt, "rounds_s": (b.rounds - a.rounds) / dt,
        "rows_per_round": ratio(b.rows - a.rows, b.rounds - a.rounds),
        "active": s.n_active, "waiting": s.n_waiting, "acceptance": ratio(b.accepted - a.accepted, b.holds - a.holds),
        "prefill": b.prefill_tokens > a.prefill_tokens,
        "serving_decay": bandit["decays"][bandit["serving"]] if bandit else None,
        "plan_version": plan["version"] if plan else None,
    }  # fmt: skip


def columns(times: list[float], points: list[dict[str, Any]]) -> dict[str, Any]:
    """The points as the schema's `Series`: one list per field, each as long as `times`."""
    keys = sorted({k for p in points for k in p["read_rate"]})
    return {"t": times, **{f: [p[f] for p in points] for f in RATE_FIELDS}, "prefill": [p["prefill"] for p in points],
            "read_rate": {k: [p["read_rate"].get(k) for p in points] for k in keys}}  # fmt: skip


class Sampler:
    """`body()`: the /v1/stats JSON, sampled anew when the last sample is `interval_s` old."""

    def __init__(self, engine: Any, lm: Any, model_name: str, requests: RequestLog,
                 pager_stats: Callable[[], dict[str, Any]] | None = None, show_text: bool = False,
                 interval_s: float = INTERVAL_S, max_samples: int = MAX_SAMPLES,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        """`pager_stats()`: the store's counters (`cost.pager_hooks`), None without a store."""
        if interval_s <= 0 or max_samples < 1:
            raise ValueError(f"bad sampling: interval {interval_s} s, {max_samples} samples")
        self.engine, self.lm, self.model_name, self.requests = engine, lm, model_name, requests
        self.pager_counters, self.show_text, self.interval_s, self.clock = pager_stats, show_text, interval_s, clock
        self.started = time.time()
        self._lock = threading.Lock()
        self._prev: Counters | None = None
        self._times: deque[float] = deque(maxlen=max_samples)
        self._points: deque[dict[str, Any]] = deque(maxlen=max_samples)
        self._body: bytes | None = None
        self._taken = -float("inf")

    def body(self) -> bytes:
        with self._lock:
            now = self.clock()
            if self._body is None or now - self._taken >= self.interval_s:
                self._body = json.dumps(self.sample(now), allow_nan=False).encode()
                self._taken = now
            return self._body

    def sample(self, now: float) -> dict[str, Any]:
        """Take a sample (whatever the time since the last): the response as plain data."""
        s = self.engine.stats()
        d = self.pager_counters() if self.pager_counters is not None else None
        pager = pager_view(self.lm, d)
        c = counters(now, s, d)
        if self._prev is not None:
            self._times.append(time.time())
            self._points.append(point(self._prev, c, s, pager, self.interval_s))
        self._prev = c
        return {
            "object": "moelane.stats", "version": 1, "model": self.model_name, "axis": "time", "now": time.time(),
            "started": self.started, "interval_s": self.interval_s, "show_text": self.show_text,
            "series": columns(list(self._times), list(self._points)), "pager": pager,
            "lanes": lanes_view(self.engine, s), "requests": self.requests.rows(),
        }  # fmt: skip
