"""Trace analytics (docs/design.md#prediction-and-prefetch): what would have covered each decode token's experts.

Per request (stream) and overall (decode-token weighted), the share of each decode token's experts found in:
prefill union, prefill tail (last prefill segment), decode recency (all earlier decode tokens of the request), the
last 1 / 2 / 4 tokens (prefill tokens included), stable (routed in every prefill segment), a frequency top-K (the
K = L * top_k experts most routed in the prefill) and two hindsight oracles: the best static set of K experts and of
the prefill union's size (the decode's own most-routed experts). Sizes are reported with every set (mean size for
the sets that move). Plus per-layer expert usage and the predictors of predict.py: the co-occurrence predictor, and
the next-layer look-ahead when the trace carries its predictions (`recall`: share of layers >= 1's routed experts
it named; layer 0 has no layer before it and is scored on repeat only).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moelane.pager.lab.predict import CooccurrencePredictor, predictor_stats
from moelane.pager.lab.replay import is_decode
from moelane.pager.trace import IntArray, Trace, token_flat_ids

SETS = ("prefill_union", "prefill_tail", "decode_recency", "last_1", "last_2", "last_4", "stable", "freq_top_k")
ORACLES = ("oracle_k", "oracle_union")


@dataclass(slots=True)
class _Request:
    prefill_segments: list[IntArray] = field(default_factory=list)  # distinct flat ids per prefill segment
    tokens: list[tuple[IntArray, bool]] = field(default_factory=list)  # (expert ids [L, K], is decode)
    ahead: list[IntArray] = field(default_factory=list)  # look-ahead [L-1, K] per token, when the trace has it


def _split_requests(trace: Trace) -> dict[int, _Request]:
    reqs: dict[int, _Request] = defaultdict(_Request)
    e = trace.header.n_experts
    for seg in trace.segments():
        decode = is_decode(seg)
        for sid in np.unique(seg.stream_ids).tolist():
            rows = seg.expert_ids[seg.stream_ids == sid].astype(np.int64)
            req = reqs[int(sid)]
            row_decode = decode or (seg.phase == "mixed" and rows.shape[0] == 1)
            if not row_decode:
                req.prefill_segments.append(np.unique(token_flat_ids(rows, e)))
            req.tokens.extend((r, row_decode) for r in rows)
            if seg.lookahead is not None:
                req.ahead.extend(seg.lookahead[seg.stream_ids == sid].astype(np.int64))
    return dict(reqs)


def _top(counts: IntArray, n: int) -> IntArray:
    live = np.flatnonzero(counts > 0)
    return live[np.lexsort((live, -counts[live]))][:n]


def _coverage(trace: Trace, req: _Request) -> tuple[dict[str, list[float]], dict[str, float], int]:
    h = trace.header
    m, e = h.n_total, h.n_experts
    offsets = np.arange(h.n_layers, dtype=np.int64)[:, None] * e
    flat = [(ids + offsets).reshape(-1) for ids, _ in req.tokens]
    decode_idx = [i for i, (_, d) in enumerate(req.tokens) if d]
    cov: dict[str, list[float]] = {k: [] for k in (*SETS, *ORACLES)}
    sizes: dict[str, list[int]] = {k: [] for k in ("decode_recency", "last_1", "last_2", "last_4")}
    if not decode_idx:
        return cov, {}, 0
    pre = req.prefill_segments
    union = np.unique(np.concatenate(pre)) if pre else np.zeros(0, np.int64)
    stable = pre[0] if pre else np.zeros(0, np.int64)
    for s in pre[1:]:
        stable = np.intersect1d(stable, s)
    per_token = h.n_layers * h.top_k
    prefill_counts = np.bincount(
        np.concatenate([flat[i] for i, (_, d) in enumerate(req.tokens) if not d] or [np.zeros(0, np.int64)]),
        minlength=m,
    )
    decode_counts = np.bincount(np.concatenate([flat[i] for i in decode_idx]), minlength=m)
    static = {
        "prefill_union": union,
        "prefill_tail": pre[-1] if pre else np.zeros(0, np.int64),
        "stable": stable,
        "freq_top_k": _top(prefill_counts, per_token),
        "oracle_k": _top(decode_counts, per_token),
        "oracle_union": _top(decode_counts, max(1, union.size)),
    }
    masks = {k: np.isin(np.arange(m), v) for k, v in static.items()}
    last_seen = np.full(m, -(10**9), np.int64)
    dec_seen = np.zeros(m, bool)
    for i, ids in enumerate(flat):
        if req.tokens[i][1]:
            for k, mask in masks.items():
                cov[k].append(float(mask[ids].mean()))
            cov["decode_recency"].append(float(dec_seen[ids].mean()))
            sizes["decode_recency"].append(int(dec_seen.sum()))
            for n in (1, 2, 4):
                cov[f"last_{n}"].append(float((last_seen[ids] >= i - n).mean()))
                sizes[f"last_{n}"].append(int((last_seen >= i - n).sum()))
            dec_seen[ids] = True
        last_seen[ids] = i
    size = {k: float(v.size) for k, v in static.items()} | {k: float(np.mean(v)) for k, v in sizes.items()}
    return cov, size, len(decode_idx)


def _predictors(trace: Trace, reqs: dict[int, _Request], n_extra: int) -> dict[int, dict[str, Any]]:
    h = trace.header
    pred = CooccurrencePredictor(h.n_layers, h.n_experts)
    out = {}
    for sid, req in reqs.items():
        pairs, guesses = [], []
        for (prev, _), (cur, dec) in zip(req.tokens, req.tokens[1:], strict=False):
            if dec:
                pairs.append((prev, cur))
                guesses.append(pred.predict(prev, n_extra))
            pred.observe(prev, cur)
        out[sid] = predictor_stats(pairs, guesses)
    return out


def _lookahead(reqs: dict[int, _Request], top_k: int) -> dict[int, dict[str, Any]]:
    out = {}
    for sid, req in reqs.items():
        pairs, guesses, hit, total = [], [], 0, 0
        for (prev, _), (cur, dec), ahead in zip(req.tokens, req.tokens[1:], req.ahead[1:], strict=False):
            if not dec:
                continue
            pairs.append((prev, cur))
            guesses.append(np.concatenate([np.full((1, top_k), -1, np.int64), ahead]))
            hit += sum(np.intersect1d(a, c).size for a, c in zip(ahead, cur[1:], strict=True))
            total += int(cur[1:].size)
        out[sid] = predictor_stats(pairs, guesses) | {"recall": hit / total if total else 0.0}
    return out


def _summarise(cov: dict[str, list[float]], size: dict[str, float]) -> dict[str, dict[str, float]]:
    return {k: {"coverage": float(np.mean(v)) if v else 0.0, "size": size.get(k, 0.0)} for k, v in cov.items()}


def layer_usage(trace: Trace) -> list[dict[str, Any]]:
    h = trace.header
    out = []
    for layer in range(h.n_layers):
        counts = np.bincount(trace.expert_ids[:, layer].reshape(-1).astype(np.int64), minlength=h.n_experts)
        p = counts / max(1, counts.sum())
        nz = p[p > 0]
        out.append(
            {
                "layer": layer,
                "distinct": int((counts > 0).sum()),
                "top1_share": float(p.max()) if p.size else 0.0,
                "effective_experts": float(np.exp(-(nz * np.log(nz)).sum())) if nz.size else 0.0,
                "counts": counts.tolist(),
            }
        )
    return out


COOCCURRENCE_BYTES = 1 << 30  # the most the co-occurrence predictor's counts may take; past it, it is left out


def analyze(trace: Trace, n_extra: int | None = None) -> dict[str, Any]:
    """The full report as plain data (what `trace analyze --json` prints)."""
    reqs = _split_requests(trace)
    h = trace.header
    # its [layers, experts, experts] counts: a few MB for real models, hundreds of GB for a synthetic 70,000 experts
    fits = h.n_layers * h.n_experts**2 * 8 <= COOCCURRENCE_BYTES
    preds = _predictors(trace, reqs, n_extra or h.top_k) if fits else None
    ahead = _lookahead(reqs, trace.header.top_k) if trace.lookahead is not None else None
    requests: list[dict[str, Any]] = []
    all_cov: dict[str, list[float]] = defaultdict(list)
    all_size: dict[str, list[float]] = defaultdict(list)
    for sid, req in reqs.items():
        cov, size, n_dec = _coverage(trace, req)
        if not n_dec:
            continue
        requests.append(
            {
                "stream": sid,
                "n_prefill_tokens": sum(1 for _, d in req.tokens if not d),
                "n_decode_tokens": n_dec,
                "coverage": _summarise(cov, size),
                "predictors": None if preds is None else preds[sid],
                **({"lookahead": ahead[sid]} if ahead is not None else {}),
            }
        )
        for k, v in cov.items():
            all_cov[k].extend(v)
        for k, s in size.items():
            all_size[k].extend([s] * n_dec)
    n_total = sum(r["n_decode_tokens"] for r in requests)

    def overall(key: str, fields: tuple[str, ...]) -> dict[str, float]:
        return {k: float(sum(r[key][k] * r[key]["n_tokens"] for r in requests) / max(1, n_total)) for k in fields}

    pred_fields = ("repeat_recall", "delta_recall", "schedulable_coverage")
    pred_overall = overall("predictors", pred_fields) if preds is not None else None
    return {
        "header": trace.header.to_dict(),
        "overall": {
            "n_requests": len(requests),
            "n_decode_tokens": n_total,
            "coverage": _summarise(dict(all_cov), {k: float(np.mean(v)) for k, v in all_size.items()}),
            "predictors": pred_overall,
            **({"lookahead": overall("lookahead", (*pred_fields, "recall"))} if ahead is not None else {}),
        },
        "requests": requests,
        "layers": layer_usage(trace),
    }
