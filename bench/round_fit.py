"""What a lanes round's cost follows on an MoE: its rows, its streams and drafts, or the distinct experts it routes to.

Runs always-drafted engines (copy drafter) over copy-heavy and open prompts at several stream counts and records,
for every decode round (no prompt chunk in it): its rows, how many are drafts, the distinct experts per MoE layer
the whole round routes to and those its streams' own rows route to (the provider's `slots` calls, counted), and the
pass's wall time. Prints the new experts per layer a draft row adds beyond its round's streams' rows, against those
a stream's row brings, and least-squares fits of round time on rows; on streams and drafts; on distinct experts; and
on rows and distinct experts (coefficients in ms, R^2, median relative error).

    python bench/round_fit.py --streams 4,8,16 --tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

import moelane
from lanes_bench import prompts
from moelane.lanes import Engine, EngineConfig


def record(lm: Any, workload: str, n: int, tokens: int) -> list[dict[str, Any]]:
    """One always-drafted engine over `n` prompts; a dict per decode round."""
    routed: list[torch.Tensor] = []
    slots = lm.provider.slots
    lm.provider.slots = lambda layer, ids: routed.append(ids.clone()) or slots(layer, ids)
    engine = Engine(lm, EngineConfig(drafter="copy"))
    forward, rounds = engine._forward, []

    def timed(windows: list[Any]) -> Any:
        routed.clear()
        t0 = time.perf_counter()
        out = forward(windows)
        seconds = time.perf_counter() - t0
        if routed and not any(w.lane.prefilling for w in windows):
            own, row = [], 0  # each stream's own row: the one before its drafts
            for w in windows:
                row += len(w.feed) + len(w.drafts)
                own.append(row - 1 - len(w.drafts))
            rounds.append({
                "rows": row, "drafts": sum(len(w.drafts) for w in windows), "streams": len(windows),
                "experts": float(np.mean([len(set(ids.reshape(-1).tolist())) for ids in routed])),
                "own_experts": float(np.mean([len(set(ids[own].reshape(-1).tolist())) for ids in routed])),
                "ms": 1e3 * seconds,
            })  # fmt: skip
        return out

    engine._forward = timed  # type: ignore[method-assign]
    try:
        for p in prompts(lm.tokenizer, workload, n):
            engine.submit(p, max_tokens=tokens, stop_token_ids=None)
        engine.run_until_idle()
    finally:
        lm.provider.slots = slots
    return rounds


def fit(rounds: list[dict[str, Any]], columns: list[str]) -> dict[str, Any]:
    t = np.array([r["ms"] for r in rounds])
    x = np.column_stack([np.ones(len(rounds))] + [np.array([float(r[c]) for r in rounds]) for c in columns])
    coef = np.linalg.lstsq(x, t, rcond=None)[0]
    pred = x @ coef
    return {
        "terms": dict(zip(["const", *columns], np.round(coef, 3).tolist(), strict=True)),
        "r2": round(float(1 - ((t - pred) ** 2).sum() / ((t - t.mean()) ** 2).sum()), 3),
        "median_rel_err": round(float(np.median(np.abs(t - pred) / t)), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the shipped model)")
    ap.add_argument("--streams", default="4,8,16")
    ap.add_argument("--workloads", default="copy,open")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = moelane.load(args.model, "auto")
    record(lm, "open", 2, 32)  # warm up (first passes, allocations)
    every: list[dict[str, Any]] = []
    for workload in args.workloads.split(","):
        rounds = [r for n in map(int, args.streams.split(",")) for r in record(lm, workload, n, args.tokens)]
        drafted = [r for r in rounds if r["drafts"]]
        new = sum(r["experts"] - r["own_experts"] for r in drafted)
        new_per_draft = new / max(1, sum(r["drafts"] for r in drafted))
        per_stream = sum(r["own_experts"] for r in rounds) / sum(r["streams"] for r in rounds)
        print(json.dumps({
            "workload": workload, "rounds": len(rounds), "drafted_rounds": len(drafted),
            "new_experts_per_draft_row": round(new_per_draft, 2), "experts_per_stream_row": round(per_stream, 2),
        }))  # fmt: skip
        every += rounds
    for r in every:
        r["base_rows"] = r["rows"] - r["drafts"]
    for columns in (["rows"], ["base_rows", "drafts"], ["experts"], ["rows", "experts"]):
        print(json.dumps({"fit": "+".join(columns), **fit(every, columns)}))


if __name__ == "__main__":
    main()
