"""`moelane bench`: how fast this machine runs a model, as users would run it.

One stream: prefill and decode tok/s of `LM.generate_ids` (eager or compiled). Several streams: the lanes engine's
aggregate tok/s with N streams sharing rounds. Prints one JSON line per round and a summary line with medians.
Cross-engine comparisons (transformers, llama.cpp) live in the repository's `bench/` scripts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

PROMPTS = (
    'def parse_header(data):\n    """Parse a header block."""\n',
    "To be, or not to be, that is the question:\n",
    "The quick brown fox jumps over the lazy dog. Then it ran",
    ":help windows\n\nThis chapter explains how to use",
)


def add_parser(sub: Any) -> None:
    from moelane.cli import add_model_args

    p = sub.add_parser("bench", help="measure prefill/decode speed (one stream) or aggregate speed (--streams N)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per stream (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="measurements to take the median of (default 3)")
    p.add_argument("--streams", type=int, default=1, help="concurrent streams through the lanes engine (default 1)")
    p.add_argument("--drafter", choices=("none", "copy", "recall", "model"), default="none",
                   help="drafter for --streams runs (default none)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="compile the one-stream decode step")
    p.set_defaults(func=cmd_bench)


def one_stream(lm: Any, tokens: int) -> dict[str, float]:
    ids = lm.tokenizer.encode(PROMPTS[0])
    t0 = time.perf_counter()
    gen = lm.generate_ids(ids, tokens, stop_ids=frozenset())
    next(gen)
    t1 = time.perf_counter()
    n = sum(1 for _ in gen)
    t2 = time.perf_counter()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": n / (t2 - t1) if n else 0.0}


def many_streams(lm: Any, n_streams: int, tokens: int, drafter: str) -> dict[str, float]:
    from moelane.lanes.config import EngineConfig
    from moelane.lanes.engine import Engine

    engine = Engine(lm, EngineConfig(drafter=drafter, max_streams=max(n_streams, 1)))
    prompts = [lm.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(n_streams)]
    t0 = time.perf_counter()
    streams = [engine.submit(p, max_tokens=tokens) for p in prompts]
    engine.run_until_idle()
    elapsed = time.perf_counter() - t0
    total = sum(len(s.token_ids) for s in streams)
    return {"aggregate_tok_s": total / elapsed, "tokens": float(total)}


def cmd_bench(args: argparse.Namespace) -> int:
    from moelane.cli import load_model
    from moelane.errors import InputError

    if args.tokens < 2 or args.rounds < 1 or args.streams < 1:
        raise InputError("--tokens must be >= 2, --rounds and --streams >= 1")
    lm = load_model(args, compile=args.compile and args.streams == 1)

    def measure() -> dict[str, float]:
        if args.streams == 1:
            return one_stream(lm, args.tokens)
        return many_streams(lm, args.streams, args.tokens, args.drafter)

    measure()  # warm-up (and compile)
    results = []
    for r in range(args.rounds):
        result = measure()
        results.append(result)
        print(json.dumps({"round": r, **{k: round(v, 1) for k, v in result.items()}}), flush=True)
    summary = {k: round(statistics.median(r[k] for r in results), 1) for k in results[0]}
    config = {"model": str(lm.folder), "dtype": args.dtype, "streams": args.streams, "tokens": args.tokens,
              "drafter": args.drafter, "compile": args.compile, "expert_memory": args.expert_memory}  # fmt: skip
    print(json.dumps({"summary": True, **config, "median": summary}), flush=True)
    sys.stdout.flush()
    return 0
