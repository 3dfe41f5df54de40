"""Prefix caching on a multi-turn conversation: time to first token and total time per turn, with the prefix cache on
and off, on the shipped default model (or `--model`).

A conversation of `--turns` turns: each request resends the whole history (a system line, then every earlier user
message and reply) and a new user message of `--message-tokens` tokens (standard library docstrings); replies are
greedy, `--reply-tokens` long at most. Each run is a fresh `Engine` on one loaded model, through all turns; runs
alternate on / off (the order turned each round), `--repeat` rounds. Every turn's reply is checked token-equal
between the two modes. Prints one JSON line per run and turn, then a summary line per turn with medians and the
on / off ratios.

    python bench/prefix_bench.py
    python bench/prefix_bench.py --turns 4 --message-tokens 300 --reply-tokens 64 --repeat 3 --compile
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from revision import git_rev

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODULES = ["json", "csv", "argparse", "subprocess", "logging", "pickle", "typing", "heapq", "string", "random"]


def messages(lm: Any, n: int, n_tokens: int) -> list[list[int]]:
    """`n` user messages of `n_tokens` tokens each: consecutive stretches of standard library module docstrings."""
    text = " ".join(" ".join((importlib.import_module(name).__doc__ or "").split()) for name in MODULES)
    ids = lm.tokenizer.encode(text)
    assert len(ids) >= n * n_tokens, f"{len(ids)} tokens of docstrings, {n} x {n_tokens} asked"
    user, assistant = lm.tokenizer.encode("\nUser: "), lm.tokenizer.encode("\nAssistant:")
    return [user + ids[i * n_tokens : (i + 1) * n_tokens] + assistant for i in range(n)]


def run_conversation(lm: Any, config: Any, turns: list[list[int]], reply_tokens: int) -> list[dict[str, Any]]:
    from moelane.lanes import Engine

    engine = Engine(lm, config)
    history = lm.tokenizer.encode("A conversation between a user and a helpful assistant who knows Python well.")
    rows = []
    for turn, message in enumerate(turns):
        prompt = history + message
        fed_before = engine.stats().prefill_tokens
        t0 = time.perf_counter()
        stream = engine.submit(prompt, reply_tokens)
        while not stream.token_ids and engine.step():
            pass
        ttft = time.perf_counter() - t0
        engine.run_until_idle()
        total = time.perf_counter() - t0
        rows.append(dict(turn=turn + 1, n_prompt=len(prompt), n_cached=stream.n_cached,
                         n_fed=engine.stats().prefill_tokens - fed_before, n_reply=len(stream.token_ids),
                         ttft_s=round(ttft, 4), total_s=round(total, 4), reply=stream.token_ids))  # fmt: skip
        history = prompt + stream.token_ids
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the shipped one)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--message-tokens", type=int, default=300)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--drafter", default="none")
    p.add_argument("--compile", action="store_true", help="compile the decode step (only prompts are then kept)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import moelane
    from moelane.lanes import EngineConfig

    lm = moelane.load(args.model, compile=args.compile)
    if args.compile:
        lm.warm_up(1, 1)
    turns = messages(lm, args.turns, args.message_tokens)
    setting = dict(rev=git_rev(), model=Path(lm.folder).name, turns=args.turns, message_tokens=args.message_tokens,
                   reply_tokens=args.reply_tokens, drafter=args.drafter, compile=args.compile,
                   threads=torch.get_num_threads())  # fmt: skip
    modes = {"on": 512, "off": 0}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    replies: dict[str, list[list[int]]] = {}
    for round_ in range(args.repeat):
        order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
        for mode in order:
            config = EngineConfig(drafter=args.drafter, prefix_cache_mb=modes[mode])
            rows = run_conversation(lm, config, turns, args.reply_tokens)
            gc.collect()  # the engine's kept caches hold slots of the model's pools until it is collected
            got = [row.pop("reply") for row in rows]
            assert replies.setdefault(mode, got) == got, "a mode's replies changed between rounds"
            for row in rows:
                print(json.dumps(dict(setting, bench="prefix", mode=mode, round=round_, **row)), flush=True)
                times.setdefault((mode, row["turn"]), []).append((row["ttft_s"], row["total_s"]))
    same = replies["on"] == replies["off"]
    for turn in range(1, args.turns + 1):
        on, off = times[("on", turn)], times[("off", turn)]
        med = {f"{m}_{k}": statistics.median(t[i] for t in ts)
               for m, ts in (("on", on), ("off", off)) for i, k in enumerate(("ttft_s", "total_s"))}  # fmt: skip
        ratios = dict(ttft_off_over_on=round(med["off_ttft_s"] / med["on_ttft_s"], 2),
                      total_off_over_on=round(med["off_total_s"] / med["on_total_s"], 2))  # fmt: skip
        medians = {k: round(v, 4) for k, v in med.items()}
        print(
            json.dumps(dict(setting, bench="prefix", summary=True, turn=turn, replies_equal=same, **medians, **ratios))
        )


if __name__ == "__main__":
    main()
