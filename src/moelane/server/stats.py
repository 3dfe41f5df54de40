"""The schema of `GET /v1/stats`, what the dashboard draws (docs/server.md, "Dashboard"); `moelane trace analyze
--html` writes the same object for a recorded trace, with `axis` "tokens" and no lanes or requests.

`series` holds one entry per sample, oldest first, every list the same length: each value is a rate over the interval
since the sample before it (null where there is nothing to divide by, and across a gap: an interval over three
sampling intervals long, when nobody watched). Everything else is the state at the last sample.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Series(Strict):
    t: list[float]  # axis "time": unix seconds at each sample; "tokens": tokens (prompt + decode) replayed so far
    hit_rate_decode: list[float | None]  # found / accesses of passes of generated rows only (drafts included)
    hit_rate_prefill: list[float | None]  # ... of passes in which a stream fed prompt rows
    stall_ms_per_token: list[float | None]  # ms passes waited for expert reads, per token committed
    read_rate: dict[str, list[float | None]]  # "level/tier" -> bytes read per second (axis "tokens": per token)
    tok_s: list[float | None]  # tokens committed per second, all streams
    rounds_s: list[float | None]
    rows_per_round: list[float | None]  # rows a round fed: prompt rows + held drafts + (committed - accepted)
    active: list[int | None]  # streams in rounds
    waiting: list[int | None]  # streams waiting for a seat
    acceptance: list[float | None]  # accepted / held draft rows
    prefill: list[bool]  # the interval fed prompt rows (a prefill -> decode boundary is where this turns false)
    serving_decay: list[float | None]  # the decay bandit's serving arm
    plan_version: list[int | None]  # plans the store has applied


class PhaseTotals(Strict):
    found: int  # expert accesses found resident (hits and prefetch hits)
    accesses: int  # (one access: one pass, one layer, one distinct expert)
    hit_rate: float | None
    stall_s: float


class LevelRead(Strict):
    level: str  # "host" (RAM copies), "disk" (shards, tier files); "storage" in a replay
    tier: str  # "native", "int8", "int4"
    bytes: int
    experts: int


class PlanView(Strict):
    version: int | None  # plans applied so far (None: applied from outside the live planner)
    budget_bytes: int
    n_pins: int
    n_hard: int
    window_k: int
    pin_mode: str
    default_tier: str


class BanditView(Strict):
    decays: list[float]  # one arm per decay
    weights: list[float]  # each arm's reward (recent share of experts its prediction covered)
    serving: int  # the arm in use


class HeatMap(Strict):
    layers: list[int]  # decoder layer index of each row
    n_experts: int
    tiers: list[str]  # tier names, by code
    tier: list[list[int]]  # [layer][expert]: tier code held at, -1: not resident
    pinned: list[list[int]]  # [layer][expert]: 0 none, 1 pinned (eviction credit), 2 hard pin
    counts: list[list[int]] | None  # [layer][expert]: passes that used it (a trace: tokens routed to it); None: none


class PagerView(Strict):
    paged: bool  # False: every expert resident, no store
    note: str | None
    policy: str | None
    n_slots: int | None
    slot_bytes: int | None
    budget_bytes: int | None
    resident_bytes: int | None
    total_bytes: int | None
    phases: dict[str, PhaseTotals]  # "decode", "prefill" (as in `Series`): since start
    reads: list[LevelRead]  # since start
    evictions: int | None  # None: not counted (a replay)
    plan: PlanView | None
    bandit: BanditView | None
    heatmap: HeatMap | None


class GuardRow(Strict):
    streams: int  # the stream count this verdict is for
    mode: Literal["plain", "drafted"]
    state: Literal["measuring", "running"]
    rounds_left: int  # measuring: measured rounds left; running: rounds until it measures the other mode again
    rate_plain: float | None  # committed tokens/s at its last measurement
    rate_drafted: float | None
    decisions: int


class LanesView(Strict):
    drafter: str
    max_streams: int
    active: int
    waiting: int
    rounds: int
    committed: int
    prefill_tokens: int
    holds: int
    accepted: int
    acceptance: float | None  # since start
    guard: list[GuardRow] | None  # None: no guard (it runs for the draft-model drafter, or --guard on)


class RequestRow(Strict):
    id: str
    endpoint: Literal["completions", "chat"]
    finished: float  # unix seconds
    choices: int
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    tok_s: float | None  # completion tokens per second after the first
    finish_reason: str | None
    experts_paged: int
    bytes_paged: int
    stall_s: float
    prompt_text: str | None  # only with --dashboard-show-text (its first characters)


class StatsResponse(Strict):
    object: Literal["moelane.stats"]
    version: Literal[1]
    model: str
    axis: Literal["time", "tokens"]
    now: float
    started: float
    interval_s: float  # least time between samples
    show_text: bool
    series: Series
    pager: PagerView | None
    lanes: LanesView | None
    requests: list[RequestRow] | None
