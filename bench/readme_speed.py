"""The README's speed table: `moelane run` as a user types it, each setting in a fresh process, the settings
alternated round by round (so that the machine's drift between rounds falls on all of them alike); decode tok/s
from each run's summary line, and each setting's median as a ratio to plain one-token decoding's median.

    python bench/readme_speed.py --rounds 3 > speed.jsonl      # JSON lines: one a run, then the summary

The last line printed to stderr is the table, in Markdown. Ratios move far less with the machine's load than tok/s
do (decode tok/s moved ~5x with load here), so the README gives ratios; the tok/s of the run are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from revision import git_rev

PROMPT = "def fibonacci(n):"
# (name, the flags after `moelane run`): the first is the baseline of the ratios
SETTINGS = (
    ("one token a step (`--drafter none`)", ["--drafter", "none", "--max-tokens", "256"]),
    ("drafts from the prompt and reply (default)", ["--max-tokens", "256"]),
    ("compiled decode step, one token a step", ["--drafter", "none", "--max-tokens", "256", "--compile", "on"]),
    ("half the experts' bytes paged (`--expert-memory 50%`)", ["--max-tokens", "256", "--expert-memory", "50%"]),
)
SUMMARY = re.compile(r"(\d+) new tokens \(([^)]*)\), prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s")


def run_once(flags: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "moelane", "run", *flags, PROMPT]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    found = SUMMARY.search(done.stderr)
    if found is None:
        raise SystemExit(f"no summary line in the stderr of {cmd}:\n{done.stderr}")
    return {"new_tokens": int(found.group(1)), "decode_tok_s": float(found.group(4)), "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every setting once (default 3)")
    args = ap.parse_args()
    for _, flags in SETTINGS:  # warm-up: the compiled graph into PyTorch's cache, files into the page cache
        run_once(flags)
    runs: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    for r in range(args.rounds):
        order = SETTINGS[r % len(SETTINGS) :] + SETTINGS[: r % len(SETTINGS)]  # (each round starts one later)
        for name, flags in order:
            result = run_once(flags)
            runs[name].append(result["decode_tok_s"])
            print(json.dumps({"round": r, "setting": name, "flags": flags, **result}), flush=True)
    base = statistics.median(runs[SETTINGS[0][0]])
    medians = {name: statistics.median(v) for name, v in runs.items()}
    git = git_rev()
    ratios = {name: round(m / base, 2) for name, m in medians.items()}
    print(json.dumps({"summary": True, "git": git, "cores": os.cpu_count(), "load": os.getloadavg(),
                      "median_decode_tok_s": medians, "ratio": ratios}))  # fmt: skip
    table = ['| `moelane run "def fibonacci(n):"` with | decode speed, x one token a step |', "|---|---:|"]
    table += [f"| {name} | {medians[name] / base:.2f}x |" for name, _ in SETTINGS]
    print("\n".join(table), file=sys.stderr)


if __name__ == "__main__":
    main()
