"""What an open dashboard costs the engine: `moelane serve` under N streaming clients for a fixed time, with and
without a dashboard watching (one GET of /dashboard and its files, then /v1/stats once a second, as the page does),
alternated round by round, a fresh server for every cell.

Each client sends streamed completions one after another until the time is up (the last one finishes); a cell's
tok/s is the completion tokens of all its requests over its wall time. Prints one JSON line per cell (with the
config, the git revision and the load average before and after) and a summary line: median tok/s of each arm, the
ratio of the medians (watched / unwatched) and each round's own ratio.

    python bench/dashboard_ab.py --rounds 4 --clients 4 --seconds 20 -- --expert-memory 50%
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from revision import git_rev

PROMPTS = [
    "def fibonacci(n):\n    ",
    "ROMEO. But soft, what light through yonder window breaks?\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "*options.txt*  For Vim version 9.0.\n\nOptions\n\n",
]
ARMS = ("unwatched", "watched")


class Server:
    """`moelane serve --port 0` in a subprocess; `url` once it says where it listens."""

    def __init__(self, serve_args: list[str], threads: str | None, timeout: float) -> None:
        cmd = [sys.executable, "-m", "moelane", "serve", "--port", "0", "--log-level", "warning", *serve_args]
        env = {**os.environ, **({"OMP_NUM_THREADS": threads} if threads else {})}
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        deadline, said = time.monotonic() + timeout, []
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            said.append(line)
            if found := re.search(r"serving \S+ on (http://\S+)/v1", line):
                self.url = found[1]
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("moelane serve did not start:\n" + "".join(said[-20:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def completion(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    return tokens


async def watch(client: httpx.AsyncClient, url: str, stop: asyncio.Event, every: float) -> int:
    """What an open dashboard asks: its page and files once, then /v1/stats every `every` seconds."""
    for path in ("/dashboard", "/dashboard/static/dashboard.js", "/dashboard/static/dashboard.css"):
        (await client.get(f"{url}{path}")).raise_for_status()
    n = 0
    while not stop.is_set():
        (await client.get(f"{url}/v1/stats")).raise_for_status()
        n += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
    return n


async def cell(url: str, args: argparse.Namespace, watched: bool) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(args.warmup):
            await completion(client, url, PROMPTS[i % len(PROMPTS)], args.max_tokens)
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(client, url, stop, args.every)) if watched else None
        deadline = time.perf_counter() + args.seconds

        async def run(i: int) -> tuple[int, int]:
            tokens = requests = 0
            while time.perf_counter() < deadline:
                tokens += await completion(client, url, PROMPTS[(i + requests) % len(PROMPTS)], args.max_tokens)
                requests += 1
            return tokens, requests

        t0 = time.perf_counter()
        done = await asyncio.gather(*(run(i) for i in range(args.clients)))
        wall = time.perf_counter() - t0
        stop.set()
        polls = await watcher if watcher is not None else 0
    tokens = sum(t for t, _ in done)
    return {"tokens": tokens, "requests": sum(n for _, n in done), "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2), "stats_polls": polls}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="rounds, each a cell of both arms (default 4)")
    p.add_argument("--clients", type=int, default=4, help="streaming clients (default 4)")
    p.add_argument("--seconds", type=float, default=20.0, help="time each cell's clients keep sending (default 20)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    p.add_argument("--warmup", type=int, default=4, help="unrecorded requests per server first (default 4)")
    p.add_argument("--every", type=float, default=1.0, help="seconds between the dashboard's polls (default 1)")
    p.add_argument("--threads", help="OMP_NUM_THREADS for the server (default: serve's own choice)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("serve_args", nargs="*", help="after --: more `moelane serve` options (--expert-memory 50%%)")
    args = p.parse_args()
    config = {k: v for k, v in vars(args).items() if k != "startup_timeout"}
    rows = []
    for rnd in range(args.rounds):
        for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:
            load_before = os.getloadavg()
            server = Server(args.serve_args, args.threads, args.startup_timeout)
            try:
                result = asyncio.run(cell(server.url, args, arm == "watched"))
            finally:
                server.stop()
            load_after = [round(x, 2) for x in os.getloadavg()]
            row = {"round": rnd, "arm": arm, **result, "load_before": [round(x, 2) for x in load_before],
                   "load_after": load_after, "config": config, "git": git_rev()}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    by_arm = {arm: [r["tok_s"] for r in rows if r["arm"] == arm] for arm in ARMS}
    per_round = [round(w / u, 3) for u, w in zip(by_arm["unwatched"], by_arm["watched"], strict=True)]
    medians = {arm: statistics.median(values) for arm, values in by_arm.items()}
    print(json.dumps({"summary": True, **{f"{arm}_tok_s_median": round(m, 2) for arm, m in medians.items()},
                      "ratio_of_medians": round(medians["watched"] / medians["unwatched"], 3),
                      "round_ratios": per_round, "git": git_rev(),
                      "script": Path(__file__).name}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
