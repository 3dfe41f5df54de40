"""Synthetic routing traces with tunable popularity skew, temporal locality and phase shifts.

For tests, benchmarks and the bandit's shifting-phase case; no model needed. Each layer routes a token by Gumbel-top-k
over log-popularity scores: a Zipf law (exponent `skew`) over a per-layer ranking that mixes a global ranking with a
per-request "topic" ranking (weight `topic_weight`, so a prompt's experts predict its reply's), plus a bonus `locality`
for the experts the previous token routed to in that layer. Every `shift_every` tokens of a request the topic is
redrawn (a phase shift). Requests run one after another: prefill in chunks of `prefill_chunk` tokens, then one decode
token per segment; stream id = request number. Deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from moelane.errors import check_number
from moelane.pager.trace import Segment, Trace, TraceHeader, trace_from_segments


@dataclass(frozen=True, slots=True)
class SynthConfig:
    n_layers: int = 8
    n_experts: int = 32
    top_k: int = 4
    expert_bytes: int = 1 << 20
    n_requests: int = 4
    prefill_tokens: int = 256
    prefill_chunk: int = 64
    decode_tokens: int = 128
    skew: float = 1.0
    locality: float = 2.0
    topic_weight: float = 0.7
    shift_every: int = 0  # 0: no phase shifts within a request
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts or self.n_layers < 1:
            raise ValueError(f"bad shape L={self.n_layers} E={self.n_experts} K={self.top_k}")
        if self.n_requests < 1 or self.prefill_tokens < 0 or self.decode_tokens < 0 or self.prefill_chunk < 1:
            raise ValueError("n_requests >= 1, prefill/decode tokens >= 0 and prefill_chunk >= 1 are required")
        check_number("skew", self.skew, 0)
        check_number("locality", self.locality, 0)
        if not 0.0 <= self.topic_weight <= 1.0 or self.shift_every < 0:
            raise ValueError("shift_every must be >= 0 and topic_weight in [0, 1]")

    def header(self) -> TraceHeader:
        b = self.expert_bytes
        return TraceHeader(
            n_layers=self.n_layers,
            n_experts=self.n_experts,
            top_k=self.top_k,
            tiers=(("bf16", b), ("int8", max(1, b // 2 + b // 64)), ("int4", max(1, b // 4 + b // 64))),
            model="synthetic",
        )


class _Router:
    """Sequential token generator for one request."""

    def __init__(self, cfg: SynthConfig, rng: np.random.Generator, global_rank: npt.NDArray[np.int64]) -> None:
        self.cfg, self.rng, self.global_rank = cfg, rng, global_rank
        self.zipf = -cfg.skew * np.log1p(np.arange(cfg.n_experts, dtype=np.float64))  # log-popularity by rank
        self.prev = np.zeros((cfg.n_layers, cfg.n_experts), np.float64)
        self.logp = self._topic()
        self.n_done = 0

    def _topic(self) -> npt.NDArray[np.float64]:
        c = self.cfg
        topic_rank = np.argsort(self.rng.random((c.n_layers, c.n_experts)), axis=1)
        g = self.zipf[self.global_rank]
        t = self.zipf[topic_rank]
        return np.asarray((1.0 - c.topic_weight) * g + c.topic_weight * t, np.float64)

    def tokens(self, n: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        c = self.cfg
        ids = np.empty((n, c.n_layers, c.top_k), np.int64)
        weights = np.empty((n, c.n_layers, c.top_k), np.float32)
        gumbel = self.rng.gumbel(size=(n, c.n_layers, c.n_experts))
        rows = np.arange(c.n_layers)[:, None]
        for t in range(n):
            if c.shift_every and self.n_done and self.n_done % c.shift_every == 0:
                self.logp = self._topic()
            scores = self.logp + c.locality * self.prev + gumbel[t]
            top = np.argpartition(-scores, c.top_k - 1, axis=1)[:, : c.top_k]
            s = scores[rows, top]
            order = np.argsort(-s, axis=1)
            top, s = top[rows, order], s[rows, order]
            e = np.exp(s - s[:, :1])
            ids[t], weights[t] = top, e / e.sum(axis=1, keepdims=True)
            self.prev[:] = 0.0
            self.prev[rows, top] = 1.0
            self.n_done += 1
        return ids, weights


def synth_trace(cfg: SynthConfig) -> Trace:
    """Generate a synthetic trace (in memory; write it with `trace.write_trace`)."""
    return trace_from_segments(cfg.header(), list(synth_segments(cfg)))


def synth_segments(cfg: SynthConfig) -> Iterator[Segment]:
    """The segments of `synth_trace(cfg)`, one at a time, request after request (to write them as they come)."""
    rng = np.random.default_rng(cfg.seed)
    global_rank = np.argsort(rng.random((cfg.n_layers, cfg.n_experts)), axis=1)
    id_dtype = cfg.header().id_dtype()
    index = 0
    for r in range(cfg.n_requests):
        router = _Router(cfg, rng, global_rank)
        chunks = [cfg.prefill_chunk] * (cfg.prefill_tokens // cfg.prefill_chunk)
        if cfg.prefill_tokens % cfg.prefill_chunk:
            chunks.append(cfg.prefill_tokens % cfg.prefill_chunk)
        plan = [(n, "prefill") for n in chunks] + [(1, "decode")] * cfg.decode_tokens
        ids_all, w_all = router.tokens(sum(n for n, _ in plan))
        a = 0
        for n, phase in plan:
            yield Segment(
                index=index,
                phase=phase,
                expert_ids=ids_all[a : a + n].astype(id_dtype),
                stream_ids=np.full(n, r, np.int64),
                weights=w_all[a : a + n],
            )
            index += 1
            a += n
