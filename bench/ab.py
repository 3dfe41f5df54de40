"""A/B protocol (SPEC 3.7) for any change that may move lanes speed: two git revisions, alternated rounds (ABBA, at
least 4), a fresh process per cell, N streams each with a different prompt, greedy, 256 tokens each; aggregate
tokens/s by round and the median stream's time to its first token, replies compared token by token across builds,
peak memory, revisions and settings recorded.

Each revision's `src/` is exported with `git archive` into a temporary folder (the working tree is not touched) and
a cell runs this same file with `--cell` under that revision's code.

    python bench/ab.py main HEAD --rounds 4 --streams 8 --drafter copy
    python bench/ab.py main HEAD --rounds 4 --streams 1 --compile
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> tuple[str, Path]:
    """`rev`'s src/ and bench/ under `into`; returns (full commit, its src folder)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True)
    sha = commit.stdout.strip()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", sha, "src", "bench"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return sha, into / "src"


def cell(args: argparse.Namespace) -> None:
    """One measurement in this process (run with the revision's src/ first on sys.path)."""
    import moelane
    from moelane.lanes import Engine, EngineConfig

    sys.path.insert(0, str(ROOT))
    from bench.lanes_bench import prompts

    lm = moelane.load(args.model or None, "auto", compile=args.compile)
    lm.eos_ids = frozenset()  # fixed work per cell
    if args.compile:
        lm.warm_up(8, args.tokens)  # the compile is not timed (PyTorch caches it across cells)
    draft = moelane.load(args.draft) if args.draft else None
    batch = prompts(lm.tokenizer, args.workload, args.streams)
    config = EngineConfig(drafter=args.drafter, max_streams=args.streams, guard=args.guard)
    engine = Engine(lm, config, draft=draft)
    first: dict[int, float] = {}  # each stream's first token: when its prompt was through
    t0 = time.perf_counter()
    streams = [engine.submit(p, max_tokens=args.tokens) for p in batch]
    for i, s in enumerate(streams):
        s.subscribe(lambda tokens, i=i: bool(tokens) and first.setdefault(i, time.perf_counter()))
    engine.run_until_idle()
    seconds = time.perf_counter() - t0
    n = sum(len(s.token_ids) for s in streams)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ttft = statistics.median(t - t0 for t in first.values())
    out = {"tok_s": n / seconds, "seconds": seconds, "ttft_s": ttft, "tokens": n, "peak_rss_bytes": peak,
           "moelane": moelane.__file__, "replies": [s.token_ids for s in streams]}  # fmt: skip
    print("CELL " + json.dumps(out), flush=True)


def run_cell(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--cell", "--model", args.model or "", "--streams", str(args.streams),
           "--tokens", str(args.tokens), "--drafter", args.drafter, "--workload", args.workload]  # fmt: skip
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.guard is not None:
        cmd += ["--guard", "on" if args.guard else "off"]
    if args.compile:
        cmd += ["--compile"]
    return run_under(src, cmd)


def run_under(src: Path, cmd: list[str]) -> dict[str, Any]:
    """Run a cell command with `src` first on the path; its `CELL {json}` line, checked to come from that build."""
    env = {**__import__("os").environ, "PYTHONPATH": str(src)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("CELL ")]
    if proc.returncode or not lines:
        raise SystemExit(f"cell failed under {src}:\n{proc.stderr[-3000:]}")
    res = dict(json.loads(lines[-1][5:]))
    if not str(res["moelane"]).startswith(str(src)):
        raise SystemExit(f"the cell imported {res['moelane']}, not the build under {src}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs="*", default=["main", "HEAD"], help="two git revisions: A (base) and B (change)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--drafter", default="none", choices=["none", "copy", "recall", "model"])
    ap.add_argument("--guard", choices=["on", "off"], default=None)
    ap.add_argument("--workload", default="open", choices=["open", "copy"])
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--compile", action="store_true", help="compile the decode step (warmed up before timing)")
    ap.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = args.model or None
    args.guard = None if args.guard is None else args.guard == "on"
    if args.cell:
        return cell(args)
    if len(args.revs) != 2 or args.rounds < 4:
        raise SystemExit("give two revisions and at least 4 rounds")
    settings = {k: v for k, v in vars(args).items() if k not in ("cell", "revs")}
    with tempfile.TemporaryDirectory(prefix="moelane-ab-") as tmp:
        builds = [export(rev, Path(tmp) / name) for rev, name in zip(args.revs, "AB", strict=True)]
        print(json.dumps({"event": "setting", "A": builds[0][0], "B": builds[1][0], **settings}), flush=True)
        tok_s: dict[str, list[float]] = {"A": [], "B": []}
        ttft: dict[str, list[float]] = {"A": [], "B": []}
        replies: dict[str, list[list[int]]] = {}
        peak: dict[str, int] = {"A": 0, "B": 0}
        mismatches = 0
        for r in range(args.rounds):
            order = "AB" if r % 2 == 0 else "BA"
            for name in order:
                res = run_cell(builds["AB".index(name)][1], args)
                tok_s[name].append(res["tok_s"])
                ttft[name].append(res["ttft_s"])
                peak[name] = max(peak[name], res["peak_rss_bytes"])
                if name in replies and replies[name] != res["replies"]:
                    mismatches += 1
                replies.setdefault(name, res["replies"])
                print(json.dumps({"event": "cell", "round": r, "build": name, "tok_s": round(res["tok_s"], 2),
                                  "ttft_s": round(res["ttft_s"], 4), "seconds": round(res["seconds"], 3),
                                  "peak_rss_bytes": res["peak_rss_bytes"]}),
                      flush=True)  # fmt: skip
        same = replies["A"] == replies["B"]
        med = {k: statistics.median(v) for k, v in tok_s.items()}
        first = {k: statistics.median(v) for k, v in ttft.items()}
        print(json.dumps({"event": "summary", "A": builds[0][0], "B": builds[1][0], "median_tok_s": med,
                          "B_over_A": round(med["B"] / med["A"], 3), "median_ttft_s": first,
                          "ttft_A_over_B": round(first["A"] / first["B"], 3), "replies_equal_across_builds": same,
                          "replies_unstable_within_build": mismatches, "peak_rss_bytes": peak, **settings}),
              flush=True)  # fmt: skip
        if not same:
            raise SystemExit("replies differ between builds")


if __name__ == "__main__":
    main()
