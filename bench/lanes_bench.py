"""Lanes engine throughput: aggregate tokens/s at 1, 2, 4, 8, 16 streams, plain / always-drafted / guarded, on
copy-heavy prompts (repeat, or repeat with a rename, a given standard library function: code is the shipped model's
domain, and it copies code it was shown; prose it barely copies) and on open generation; all in one run, with the
ratios the issue asks for and a token-identity check of every reply against plain mode.

With `--repeat N` every cell runs N times (all cells of a round before the next round, the order of the modes turned
by one each round) and the summary gives medians; guarded / best is the median over rounds of each round's ratio
(its cells run side by side, so the machine's drift between rounds cancels).
Each cell is a fresh `Engine` on one loaded model: N streams, each with a different prompt, greedy, `--tokens`
tokens each (no EOS stop, so every cell does the same work), timed from the first submit to idle. Prints one JSON
line per cell and a summary line.

    python bench/lanes_bench.py --tokens 128 --drafter copy
    python bench/lanes_bench.py --tokens 256 --drafter copy --compile --warm
    python bench/lanes_bench.py --tokens 256 --drafter copy --warm-counts --warm-tokens 64 --repeat 3
    python bench/lanes_bench.py --model PATH --drafter model --draft PATH
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from revision import git_rev

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODULES = ["json", "csv", "argparse", "textwrap", "collections", "functools", "itertools", "pathlib", "logging",
           "unittest", "string", "random", "heapq", "bisect", "shutil", "pickle", "typing", "subprocess"]  # fmt: skip
MODES = {"plain": dict(drafter="none"), "drafted": dict(guard=False), "guarded": dict(guard=True)}


def passages(n: int, chars: int = 500) -> list[str]:
    """`n` different passages of text every Python install has: standard library module docstrings."""
    out = []
    for name in MODULES * (n // len(MODULES) + 1):
        doc = " ".join((importlib.import_module(name).__doc__ or name).split())
        out.append(doc[len(out) // len(MODULES) * 50 :][:chars])
    return out[:n]


def functions(n: int, shortest: int = 300, longest: int = 900) -> list[str]:
    """`n` different Python functions every install has: standard library sources, the shipped model's domain."""
    out: list[str] = []
    for name in MODULES * 4:
        module = importlib.import_module(name)
        for _, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != name:
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if shortest <= len(source) <= longest and source not in out:
                out.append(source)
                break
        if len(out) == n:
            return out
    raise RuntimeError(f"found only {len(out)} standard library functions of {shortest}-{longest} characters")


def prompts(tokenizer: Any, workload: str, n: int) -> list[list[int]]:
    texts = passages(n)
    if workload == "copy":  # repeat (or edit) a given function: the reply is mostly in the prompt
        made = []
        for i, source in enumerate(functions(n)):
            first = source.splitlines()[0]
            if i % 2 == 0:
                made.append(f"{source}\n\n# The same function again:\n{first}\n")
            else:
                made.append(f"{source}\n\n# The same function, renamed:\n{first.replace('def ', 'def new_', 1)}\n")
    else:  # open generation: the first sentence of a passage and nothing to copy
        made = [t.split(". ")[0] + "." for t in texts]
    return [tokenizer.encode(m) for m in made]


def run_cell(
    lm: Any,
    draft: Any,
    config: dict[str, Any],
    batch: list[list[int]],
    tokens: int,
    warm: list[list[list[int]]] | None = None,
    warm_tokens: int = 0,
) -> dict[str, Any]:
    """One fresh engine; with `warm`, batches of other prompts go through it first, one batch at a time (untimed),
    so that the cell measures a serving engine in its steady state (calibrated prices, the guard's first
    measurements done at the stream counts the batches ran)."""
    from moelane.lanes import Engine, EngineConfig

    engine = Engine(lm, EngineConfig(**config), draft=draft)
    for warm_batch in warm or []:
        for p in warm_batch:
            engine.submit(p, max_tokens=warm_tokens or tokens)
        engine.run_until_idle()
    before = engine.stats()
    t0 = time.perf_counter()
    streams = [engine.submit(p, max_tokens=tokens, stop_token_ids=None) for p in batch]
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    n_tokens = sum(len(s.token_ids) for s in streams)
    return {
        "tok_s": n_tokens / seconds, "seconds": seconds, "tokens": n_tokens, "rounds": stats.rounds - before.rounds,
        "holds": stats.holds - before.holds, "accepted": stats.accepted - before.accepted, "guard": stats.guard_modes,
        "replies": [s.token_ids for s in streams],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--draft", default=None, help="draft model folder for --drafter model (default: shipped)")
    ap.add_argument("--drafter", default="copy", choices=["copy", "recall", "model"])
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--workloads", default="copy,open")
    ap.add_argument("--modes", default="plain,drafted,guarded")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--warm", action="store_true", help="put a batch of other prompts through each engine first")
    ap.add_argument(
        "--warm-counts",
        action="store_true",
        help="warm with batches of every stream count from N down to 1 (each count's guard entry decides "
        "before the timed batch, as in a server that has seen every load); implies --warm",
    )
    ap.add_argument("--warm-tokens", type=int, default=0, help="tokens per warm-up stream (default: --tokens)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all cells (modes alternated); medians reported")
    ap.add_argument("--compile", action="store_true", help="compile the target's decode step (generated rows)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import moelane

    lm = moelane.load(args.model, compile=args.compile)
    draft = None
    if args.drafter == "model":
        from moelane.lanes.drafters import load_draft_model

        draft = load_draft_model(args.draft)  # its decode step compiled (the engine's default)
    # the engine's own stop ids would end replies at different lengths; benchmark fixed work instead
    lm.eos_ids = frozenset()
    setting = {"model": args.model or "shipped", "drafter": args.drafter, "tokens": args.tokens, "rev": git_rev(),
               "threads": torch.get_num_threads(), "max_depth": args.max_depth, "warm": args.warm or args.warm_counts,
               "warm_counts": args.warm_counts, "warm_tokens": args.warm_tokens or args.tokens,
               "compiled": args.compile}  # fmt: skip
    print(json.dumps({"event": "setting", **setting}), flush=True)
    counts = [int(x) for x in args.streams.split(",")]
    samples: dict[tuple[str, int, str], list[float]] = {}
    mismatches = 0
    run_cell(lm, draft, dict(drafter="none"), prompts(lm.tokenizer, "open", 1), 8)  # warm up
    modes = args.modes.split(",")
    for r in range(args.repeat):
        for workload in args.workloads.split(","):
            batches = {n: prompts(lm.tokenizer, workload, n) for n in counts}
            warm = {n: warm_batches(lm.tokenizer, workload, n, args) for n in counts}
            for n in counts:
                replies: dict[str, list[list[int]]] = {}
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    config = {"drafter": args.drafter, "max_streams": n, "max_depth": args.max_depth, **MODES[mode]}
                    cell = run_cell(lm, draft, config, batches[n], args.tokens, warm[n], args.warm_tokens)
                    replies[mode] = cell.pop("replies")
                    samples.setdefault((workload, n, mode), []).append(cell["tok_s"])
                    print(json.dumps({"event": "cell", "round": r, "workload": workload, "streams": n, "mode": mode,
                                      **cell}), flush=True)  # fmt: skip
                first = next(iter(replies.values()))  # every mode's replies must be the same (plain's, if it ran)
                mismatches += sum(got != replies.get("plain", first) for got in replies.values())
    results = {k: statistics.median(v) for k, v in samples.items()}
    print(json.dumps({"event": "summary", **setting, "repeat": args.repeat, "mismatches": mismatches,
                      **ratios(results, counts), **paired(samples, counts)}), flush=True)  # fmt: skip


def warm_batches(tokenizer: Any, workload: str, n: int, args: argparse.Namespace) -> list[list[list[int]]]:
    """Warm-up batches for a cell of `n` streams: prompts other than the cell's own (the same workload). `--warm`:
    one batch of n; `--warm-counts`: batches of n, n-1, ..., 1."""
    if not (args.warm or args.warm_counts):
        return []
    others = prompts(tokenizer, workload, 2 * n)[n:]
    return [others[:k] for k in range(n, 0, -1)] if args.warm_counts else [others]


def ratios(results: dict[tuple[str, int, str], float], counts: list[int]) -> dict[str, Any]:
    """The issue's ratios from the cells' median tok/s."""
    out: dict[str, Any] = {}
    for workload in ("copy", "open"):
        r = {k[1:]: v for k, v in results.items() if k[0] == workload}
        if (1, "plain") in r and (8, "plain") in r:
            out[f"{workload}_plain_8_over_1"] = round(r[(8, "plain")] / r[(1, "plain")], 2)
        if (1, "plain") in r and (1, "drafted") in r:
            out[f"{workload}_drafted_over_plain_at_1"] = round(r[(1, "drafted")] / r[(1, "plain")], 2)
        out[f"{workload}_tok_s"] = {f"{n}/{m}": round(v, 1) for (n, m), v in sorted(r.items())}
    return out


def paired(samples: dict[tuple[str, int, str], list[float]], counts: list[int]) -> dict[str, Any]:
    """Guarded / the better fixed mode, per stream count: the median over rounds of the ratio within a round."""
    out: dict[str, Any] = {}
    for workload in ("copy", "open"):
        guarded = {}
        for n in counts:
            runs = [samples.get((workload, n, m)) for m in ("plain", "drafted", "guarded")]
            if all(runs):
                plain, drafted, ours = runs
                assert plain is not None and drafted is not None and ours is not None
                per_round = [g / max(p, d) for p, d, g in zip(plain, drafted, ours, strict=True)]
                guarded[n] = round(statistics.median(per_round), 2)
        if guarded:
            out[f"{workload}_guarded_over_best"] = guarded
    return out


if __name__ == "__main__":
    main()
