"""`moelane bench`: how fast this machine runs a model, as users would run it.

One stream: prefill and decode tok/s of `LM.generate_ids` (eager or compiled). Several streams: the lanes engine's
aggregate tok/s with N streams sharing rounds. Prints a small table (each round, then their medians) and the
settings measured; with --json, one JSON line per round and a summary line with the medians and the settings.
Cross-engine comparisons (transformers, llama.cpp) live in the repository's `bench/` scripts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from moelane.commands.common import add_model_args, load_model

PROMPTS = (
    'def parse_header(data):\n    """Parse a header block."""\n',
    "To be, or not to be, that is the question:\n",
    "The quick brown fox jumps over the lazy dog. Then it ran",
    ":help windows\n\nThis chapter explains how to use",
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure prefill/decode speed (one stream) or aggregate speed (--streams N)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=128,
                   help="tokens generated per stream (default 128; 2 to what the context holds)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3,
                   help="measurements to take the median of, after one warm-up round (default 3)")  # fmt: skip
    p.add_argument("--streams", type=int, default=1, help="concurrent streams through the lanes engine (default 1)")
    p.add_argument("--drafter", choices=("none", "copy", "recall", "model"), default="none",
                   help="drafter for --streams N > 1 runs (default none)")  # fmt: skip
    p.add_argument("--compile", action="store_true", help="compile the one-stream decode step (--streams 1 only)")
    p.add_argument("--json", action="store_true",
                   help="JSON lines instead: one a round, then a summary (medians, settings)")  # fmt: skip
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


def many_streams(lm: Any, n_streams: int, tokens: int, config: Any) -> dict[str, float]:
    from moelane.lanes.engine import Engine

    engine = Engine(lm, config)
    prompts = [lm.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))) for i in range(n_streams)]
    t0 = time.perf_counter()
    streams = [engine.submit(p, max_tokens=tokens) for p in prompts]
    engine.run_until_idle()
    elapsed = time.perf_counter() - t0
    total = sum(len(s.token_ids) for s in streams)
    return {"aggregate_tok_s": total / elapsed, "tokens": float(total)}


def check_args(args: argparse.Namespace) -> Any:
    """Settings that cannot work or would be ignored, said in one line before the model loads; -> the engine's
    config for --streams N > 1 (None for one stream)."""
    from moelane.errors import InputError
    from moelane.lanes.config import EngineConfig

    for flag, value, least in (("--tokens", args.tokens, 2), ("--rounds", args.rounds, 1),
                               ("--streams", args.streams, 1)):  # fmt: skip
        if value < least:
            raise InputError(f"{flag} must be >= {least}, got {value}")
    if args.streams == 1:
        if args.drafter != "none":
            raise InputError("--drafter applies to the lanes engine: it needs --streams N > 1")
        return None
    if args.compile:
        raise InputError("--compile compiles the one-stream decode step: it does not apply with --streams N > 1")
    rows = EngineConfig().max_rows
    if args.streams > rows:
        raise InputError(f"--streams must be at most {rows} (the rows of one engine round), got {args.streams}")
    return EngineConfig(drafter=args.drafter, max_streams=args.streams)


def cmd_bench(args: argparse.Namespace) -> int:
    config = check_args(args)
    lm = load_model(args, compile=args.compile)
    try:
        return bench_loaded(lm, args, config)
    finally:
        lm.close()  # an expert store's threads end before the interpreter does


def bench_loaded(lm, args: argparse.Namespace, config: Any) -> int:  # type: ignore[no-untyped-def]
    from moelane.errors import InputError

    if (room := lm.max_context - len(lm.tokenizer.encode(max(PROMPTS, key=len)))) < args.tokens:
        raise InputError(f"--tokens must be at most {room} (the model's context less the prompt), got {args.tokens}")

    def measure() -> dict[str, float]:
        if config is None:
            return one_stream(lm, args.tokens)
        return many_streams(lm, args.streams, args.tokens, config)

    print("warm-up round" + (" (compiling the decode step: 10-60 s the first time)" if args.compile else "") + "...",
          file=sys.stderr, flush=True)  # fmt: skip
    if args.compile:
        lm.warm_up(1, 1)  # one graph for every cache size (where it cannot be compiled: eager, said in one line)
    measure()  # warm-up
    results = []
    for r in range(args.rounds):
        result = measure()
        results.append(result)
        if args.json:
            print(json.dumps({"round": r, **{k: round(v, 1) for k, v in result.items()}}), flush=True)
    summary = {k: round(statistics.median(r[k] for r in results), 1) for k in results[0]}
    config = {"model": str(lm.folder), "dtype": str(lm.dtype).removeprefix("torch."), "streams": args.streams,
              "tokens": args.tokens, "drafter": args.drafter, "compile": lm.compile_enabled,
              "expert_memory": None if args.expert_memory is None else str(args.expert_memory)}  # fmt: skip
    if args.json:
        print(json.dumps({"summary": True, **config, "median": summary}), flush=True)
    else:
        sys.stdout.write(format_table(results, summary, config))
    sys.stdout.flush()
    return 0


COLUMNS = {"prefill_tok_s": "prefill tok/s", "decode_tok_s": "decode tok/s", "aggregate_tok_s": "aggregate tok/s",
           "tokens": "tokens"}  # fmt: skip


def format_table(results: list[dict[str, float]], median: dict[str, float], config: dict[str, Any]) -> str:
    """Each round's figures and their medians as a table, under a line that says what was measured."""
    streams = config["streams"]
    what = [f"{config['model']} ({config['dtype']})", f"{streams} stream{'s' * (streams != 1)}",
            f"{config['tokens']} tokens each", "compiled" if config["compile"] else "eager"]  # fmt: skip
    if streams > 1:
        what.append(f"drafter {config['drafter']}")
    if config["expert_memory"] is not None:
        what.append(f"--expert-memory {config['expert_memory']}")
    keys = list(median)
    width = {k: max(len(COLUMNS.get(k, k)), 8) + 2 for k in keys}

    def row(name: object, values: dict[str, float]) -> str:
        return f"{name!s:<8}" + "".join(f"{values[k]:>{width[k]}.{0 if k == 'tokens' else 1}f}" for k in keys)

    lines = [", ".join(what), f"{'round':<8}" + "".join(f"{COLUMNS.get(k, k):>{width[k]}}" for k in keys)]
    lines += [row(i, r) for i, r in enumerate(results, 1)]
    lines.append(row("median", median))
    return "\n".join(lines) + "\n"
