"""The decode step exported and compiled ahead of time (`moelane.model.exported`, the engine's compiled step) against
the same step through `torch.compile` (Dynamo, then Inductor's Python wrapper), on one model, in one process.

    python bench/export_step.py --model DIR [--quant int4] [--calls 300] [--rounds 3]

Two LMs of the same weights: one as `moelane.load(compile=True)` makes it (exported), one with
`enable_compile(ahead=False)`. Each round times one-row `LM.forward` decode calls on each, alternated, and prints
the medians in us; the summary gives the medians over rounds, the speedup, the first call's seconds on each side
(the export and compile, or the cached library's load), and the largest difference of their logits (the two
compilers may order a reduction otherwise: docs/kernels.md "The engine's compiled step").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import moelane
from moelane.model.cache import Rows
from moelane.model.exported import AheadOrCompiled

sys.path.insert(0, str(Path(__file__).parent))
import decode_bench  # (bench/: its precision settings)


def median_us(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder (bench/decode_bench.py builds the 115M one)")
    ap.add_argument("--quant", default="int4", choices=sorted(decode_bench.SETTINGS))
    ap.add_argument("--calls", type=int, default=300, help="timed calls per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = decode_bench.SETTINGS[args.quant]
    sides: dict[str, Any] = {}
    first_s: dict[str, float] = {}
    logits: dict[str, torch.Tensor] = {}
    for name, ahead in (("exported", True), ("dynamo", False)):
        lm = moelane.load(Path(args.model), s.dtype, default_tier=s.default_tier, quantize=s.quantize)
        lm.enable_compile(ahead=ahead)
        cache = lm.new_cache(256)
        lm.forward([Rows(cache, list(range(10, 26)), 0)])
        t = time.perf_counter()
        logits[name] = lm.forward([Rows(cache, [13], 16, decode=True)])[0]
        first_s[name] = time.perf_counter() - t
        if ahead and (not isinstance(lm._compiled, AheadOrCompiled) or lm._compiled.exported is None):
            sys.exit("the exported step fell back to torch.compile (see the warning above)")
        sides[name] = (lm, cache)

    def call(name: str) -> None:
        lm, cache = sides[name]
        lm.forward([Rows(cache, [13], 16, decode=True)])

    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in ("dynamo", "exported") if r % 2 else ("exported", "dynamo"):
            times[name].append(median_us(lambda: call(name), args.calls))  # noqa: B023
        print(json.dumps({"round": r, **{f"{k}_us": round(v[-1]) for k, v in times.items()}}), flush=True)
    exported, dynamo = (statistics.median(times[k]) for k in ("exported", "dynamo"))
    print(json.dumps({
        "summary": True, "git": decode_bench.git_rev(), "model": args.model, "quant": args.quant,
        "threads": args.threads, "dynamo_us": round(dynamo), "exported_us": round(exported),
        "speedup": round(dynamo / exported, 3), "first_call_s": {k: round(v, 1) for k, v in first_s.items()},
        "max_logit_diff": float((logits["exported"] - logits["dynamo"]).abs().max()),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
