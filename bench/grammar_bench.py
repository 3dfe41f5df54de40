"""What holding replies to JSON costs: the lanes engine's aggregate tokens/s with a `response_format`-style grammar
per stream against the same streams free, side by side in one process, and a mask's time per token.

Each cell runs N streams (greedy, `--tokens` each, copy drafter) over prompts that invite JSON, with each stream's
own grammar (a bounded object schema, or any JSON object with `--any`) or with none; the cells alternate
(free, held, free, held, ...) `--repeat` times and the medians are printed, with the held replies checked to
parse where they finished. The mask's time is `Grammar.allowed` per token, over the held replies.

    python bench/grammar_bench.py --streams 1,8 --tokens 128 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import moelane
from moelane.lanes import Engine, EngineConfig
from moelane.model.grammar import Grammar, json_grammar
from revision import git_rev

PROMPTS = [
    "def user():\n    return ",
    "The settings, as JSON: ",
    '{"name": "ada", "age": 36, "tags": ["math"]}\n{"name": "alan", "age": 41, "tags": ["logic", "code"]}\n',
    "config = ",
    "# a user record\nrecord = ",
    "ROMEO:\n",
    "import json\n\ndata = json.loads('",
    "response = ",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def cell(lm: Any, n: int, tokens: int, grammar: Grammar | None) -> tuple[float, list[list[int]]]:
    engine = Engine(lm, EngineConfig(drafter="copy"))
    ids = [lm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
    start = time.perf_counter()
    streams = [engine.submit(p, tokens, grammar=grammar.fresh() if grammar else None) for p in ids]
    engine.run_until_idle()
    seconds = time.perf_counter() - start
    replies = [s.token_ids for s in streams]
    return sum(len(r) for r in replies) / seconds, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8", help="stream counts, comma-separated (default 1,8)")
    ap.add_argument("--tokens", type=int, default=128, help="max tokens per stream (default 128)")
    ap.add_argument("--repeat", type=int, default=3, help="alternated pairs of cells per count (default 3)")
    ap.add_argument("--any", action="store_true", help="any JSON object, not the bounded schema")
    args = ap.parse_args()
    lm = moelane.load()
    grammar = Grammar.for_lm(lm, json_grammar(None if args.any else SCHEMA))
    revision = git_rev()
    cell(lm, 1, 8, grammar)  # (warm-up)
    for n in (int(s) for s in args.streams.split(",")):
        free, held, parsed, finished, held_replies = [], [], 0, 0, []
        for _ in range(args.repeat):
            free.append(cell(lm, n, args.tokens, None)[0])
            rate, replies = cell(lm, n, args.tokens, grammar)
            held.append(rate)
            held_replies = replies
        for reply in held_replies:
            if len(reply) < args.tokens:
                finished += 1
                try:
                    json.loads(lm.tokenizer.decode(reply))
                    parsed += 1
                except ValueError:
                    pass
        mask_us = []
        for reply in held_replies:
            g = grammar.fresh()
            for k in range(len(reply) + 1):
                t = time.perf_counter()
                g.allowed(reply[:k])
                mask_us.append((time.perf_counter() - t) * 1e6)
        ratio = statistics.median(h / f for h, f in zip(held, free, strict=True))
        row = {"bench": "grammar", "git": revision, "streams": n, "tokens": args.tokens,
               "schema": "any" if args.any else "bounded", "free_tok_s": round(statistics.median(free), 1),
               "held_tok_s": round(statistics.median(held), 1), "held_over_free": round(ratio, 3),
               "finished": finished, "parsed": parsed,
               "mask_us_median": round(statistics.median(mask_us), 1)}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
