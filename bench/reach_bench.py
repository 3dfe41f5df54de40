"""Decode speed of one stream whose KV cache reserves far more positions than it uses, as a chat request without
`max_tokens` does (its cache is the whole context): two git revisions, alternated (ABBA), a fresh process per cell,
eager and compiled, the replies compared token by token across builds.

    python bench/reach_bench.py c2af787 HEAD --rounds 4 --reserve 1900 --tokens 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab import export, run_under

PROMPT = "def fibonacci(n):\n    "
SKIP = 10  # the first tokens are not timed


def cell(args: argparse.Namespace) -> None:
    """One measurement in this process (run with the revision's src/ first on sys.path)."""
    import torch

    import moelane

    if args.threads:
        torch.set_num_threads(args.threads)
    compiled = args.mode == "compiled"
    lm = moelane.load(args.model, compile=compiled)
    prompt = lm.tokenizer.encode(PROMPT)
    if compiled:
        lm.warm_up(len(prompt), args.reserve)  # the compile is not timed (PyTorch caches it across cells)
    stamps, reply = [], []
    for token in lm.generate_ids(prompt, args.reserve, stop_ids=frozenset()):
        stamps.append(time.perf_counter())
        reply.append(token)
        if len(reply) == args.tokens:
            break
    tok_s = (len(stamps) - 1 - SKIP) / (stamps[-1] - stamps[SKIP])
    print("CELL " + json.dumps({"tok_s": tok_s, "reply": reply, "moelane": moelane.__file__}), flush=True)


def run_cell(src: Path, mode: str, args: argparse.Namespace) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--cell", "--mode", mode, "--reserve", str(args.reserve), "--tokens",
           str(args.tokens), "--threads", str(args.threads)]  # fmt: skip
    cmd += ["--model", args.model] if args.model else []
    return run_under(src, cmd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="*", default=["main", "HEAD"], help="two git revisions: A (base) and B (change)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reserve", type=int, default=1900, help="max_tokens the cache is sized for (default 1900)")
    ap.add_argument("--tokens", type=int, default=300, help="tokens decoded (default 300)")
    ap.add_argument("--modes", default="compiled,eager")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        return cell(args)
    if len(args.revs) != 2 or args.rounds < 2 or args.tokens <= SKIP + 1:
        raise SystemExit(f"give two revisions, at least 2 rounds and more than {SKIP + 1} tokens")
    with tempfile.TemporaryDirectory(prefix="moelane-reach-") as tmp:
        builds = [export(rev, Path(tmp) / name) for rev, name in zip(args.revs, "AB", strict=True)]
        settings = {k: v for k, v in vars(args).items() if k not in ("cell", "revs", "mode")}
        print(json.dumps({"event": "setting", "A": builds[0][0], "B": builds[1][0], **settings}), flush=True)
        summary = {}
        for mode in args.modes.split(","):
            tok_s: dict[str, list[float]] = {"A": [], "B": []}
            replies: dict[str, object] = {}
            for r in range(args.rounds):
                for name in "AB" if r % 2 == 0 else "BA":
                    res = run_cell(builds["AB".index(name)][1], mode, args)
                    tok_s[name].append(float(res["tok_s"]))  # type: ignore[arg-type]
                    replies.setdefault(name, res["reply"])
                    print(json.dumps({"event": "cell", "mode": mode, "round": r, "build": name,
                                      "tok_s": round(tok_s[name][-1], 1)}), flush=True)  # fmt: skip
            med = {k: round(statistics.median(v), 1) for k, v in tok_s.items()}
            summary[mode] = {"median_tok_s": med, "B_over_A": round(med["B"] / med["A"], 2),
                             "replies_equal": replies["A"] == replies["B"]}  # fmt: skip
        print(json.dumps({"event": "summary", **summary, **settings}), flush=True)


if __name__ == "__main__":
    main()
