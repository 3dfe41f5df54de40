"""Hit rate (and predicted tok/s) against pool size for every policy: the `--sweep` of `trace replay`.

LRU takes one pass for all sizes: with a global pool and whole steps admitted together, LRU's resident set after
any step is the top-N experts by (last access step, smaller id first) (an inclusion property, proved in the docs), so
an access hits in a pool of N slots exactly when its LRU rank is below N. `lru_ranks` computes every access's rank
once; `lru_sweep` turns ranks into a `ReplayResult` per size. Other policies replay once per size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moelane.pager.lab.policies import make_policy
from moelane.pager.lab.replay import CostModel, PhaseStats, ReplayResult, is_decode, layer_steps, replay
from moelane.pager.trace import IntArray, Trace, token_flat_ids

COLD = np.iinfo(np.int64).max


@dataclass(frozen=True, slots=True, eq=False)
class Ranks:
    """Per access: LRU rank (COLD for a first access), step index; per step: decode token index or -1."""

    rank: IntArray
    step: IntArray
    step_token: IntArray
    step_pos: IntArray  # per step: decode position within the request (decode steps only)


def lru_ranks(trace: Trace) -> Ranks:
    m = trace.header.n_total
    ids_desc = m - 1 - np.arange(m, dtype=np.int64)
    last = np.full(m, -1, np.int64)
    ranks: list[IntArray] = []
    steps: list[IntArray] = []
    step_token: list[int] = []
    step_pos: list[int] = []
    n_step, n_token = 0, 0
    pos: dict[int, int] = {}
    for seg in trace.segments():
        decode = is_decode(seg)
        stream = int(seg.stream_ids[0]) if seg.n_tokens else -1
        if seg.phase == "prefill":
            pos[stream] = 0
        for ids in layer_steps(token_flat_ids(seg.expert_ids, trace.header.n_experts)):
            comp = last * m + ids_desc
            cx = comp[ids]
            r = (comp[None, :] > cx[:, None]).sum(axis=1)
            ranks.append(np.where(last[ids] >= 0, r, COLD))
            steps.append(np.full(ids.size, n_step, np.int64))
            step_token.append(n_token if decode else -1)
            step_pos.append(pos.get(stream, 0) if decode else -1)
            last[ids] = n_step
            n_step += 1
        if decode:
            n_token += 1
            pos[stream] = pos.get(stream, 0) + 1
    cat = np.concatenate if ranks else (lambda _: np.zeros(0, np.int64))
    return Ranks(cat(ranks), cat(steps), np.array(step_token, np.int64), np.array(step_pos, np.int64))


def lru_sweep(
    trace: Trace, capacities: list[int], cost: CostModel | None = None, ranks: Ranks | None = None
) -> list[ReplayResult]:
    """LRU at every slot count in one pass over the trace."""
    cost = cost or CostModel()
    ranks = ranks or lru_ranks(trace)
    eb = trace.header.expert_bytes
    n_steps = ranks.step_token.size
    decode_step = ranks.step_token >= 0
    n_tokens = int(ranks.step_token.max()) + 1 if decode_step.any() else 0
    acc_per_step = np.bincount(ranks.step, minlength=n_steps)
    out = []
    for n in capacities:
        miss_per_step = np.bincount(ranks.step, weights=(ranks.rank >= n).astype(np.float64), minlength=n_steps)
        stall = (miss_per_step > 0) * cost.latency + miss_per_step * eb / cost.bandwidth
        phases = {}
        for name, sel in (("prefill", ~decode_step), ("decode", decode_step)):
            acc = int(acc_per_step[sel].sum())
            misses = int(miss_per_step[sel].sum())
            phases[name] = PhaseStats(acc, acc - misses, misses * eb, float(stall[sel].sum()), 0)
        tok = ranks.step_token[decode_step]
        token_hits = np.bincount(tok, weights=(acc_per_step - miss_per_step)[decode_step], minlength=n_tokens)
        token_acc = np.bincount(tok, weights=acc_per_step[decode_step], minlength=n_tokens)
        token_pos = np.zeros(n_tokens, np.int64)
        token_pos[tok] = ranks.step_pos[decode_step]
        phases["decode"].n_tokens = n_tokens
        phases["prefill"].n_tokens = trace.n_tokens - n_tokens
        out.append(
            ReplayResult(
                policy="lru",
                capacity=n,
                unit="slots",
                prefill=phases["prefill"],
                decode=phases["decode"],
                warm_bytes=0,
                cost=cost,
                token_hits=token_hits.astype(np.int64),
                token_accesses=token_acc.astype(np.int64),
                token_stall=np.bincount(tok, weights=stall[decode_step], minlength=n_tokens).astype(np.float64),
                token_pos=token_pos,
            )
        )
    return out


def sweep(
    trace: Trace, policies: list[str], capacities: list[int], cost: CostModel | None = None
) -> list[dict[str, Any]]:
    """Rows of {policy, capacity (slots), fraction of all experts, metrics...} for every policy and size."""
    cost = cost or CostModel()
    m = trace.header.n_total
    rows: list[dict[str, Any]] = []
    for spec in policies:
        if spec == "lru":
            results = lru_sweep(trace, capacities, cost)
        else:
            results = [replay(trace, make_policy(spec), n, "slots", cost) for n in capacities]
        for r in results:
            rows.append({**r.to_dict(), "policy": spec, "fraction": r.capacity / m})
    return rows


def default_capacities(
    trace: Trace, fractions: tuple[float, ...] = (0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75)
) -> list[int]:
    """Slot counts at fractions of all experts, never below the largest step (which must fit whole)."""
    h = trace.header
    floor = max(h.top_k, max_step_size(trace))
    caps = sorted({max(floor, round(f * h.n_total)) for f in fractions})
    return caps


def max_step_size(trace: Trace) -> int:
    biggest = 0
    for seg in trace.segments():
        for ids in layer_steps(token_flat_ids(seg.expert_ids, trace.header.n_experts)):
            biggest = max(biggest, int(ids.size))
    return biggest
