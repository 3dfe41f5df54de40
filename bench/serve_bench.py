"""Serving benchmark: moelane's OpenAI server against `llama_cpp.server` (llama-cpp-python's) on the same model, the
same prompts, in the same run (both servers up at once, measured in turn at each client count).

For each server and each client count (default 1, 4, 8, 16): every client sends `--requests` streamed greedy
completions one after another; we measure aggregate completion tokens/s (all tokens / wall time), time to first
token (request sent -> first text chunk) and inter-token latency (per request: (last chunk - first chunk) /
(tokens - 1)), p50 and p99 over requests; and, while the clients stream, how long `GET /v1/models` takes (asked every
0.1 s: whether the server's HTTP side stays responsive while it decodes), p50 and p99. Before the first round each
server serves `--warmup` unrecorded full-length requests, so neither is measured cold. Prints one JSON line per
(server, clients, round) and a summary line: per client count, each server's median tok/s over the rounds
(`--repeat`, the servers' order swapped each round), the ratio of the medians, and each round's ratio.

llama.cpp needs the model as GGUF: pass `--gguf FILE`, or `--llama-cpp DIR` (the llama.cpp tree in the
llama-cpp-python sdist, `vendor/llama.cpp`) to convert the model folder with its `convert_hf_to_gguf.py` (f32; a
byte-level BPE tokenizer it does not know is declared "gpt-2", the same pre-tokenizer). The llama server runs with an
f32 KV cache (`--type_k 0 --type_v 0`) and `--threads` threads (every core by default); moelane runs with its
serve default (every core) unless `--moelane-threads` says otherwise.

    python bench/serve_bench.py --llama-python /path/venv/bin/python --llama-cpp /path/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_gguf
from revision import git_rev

PROMPTS = [
    "def fibonacci(n):\n    ",
    "ROMEO. But soft, what light through yonder window breaks?\n",
    "*options.txt*  For Vim version 9.0.\n\nOptions\t\t\t\t\t\t*options*\n\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "HAMLET. To be, or not to be, that is the question:\n",
    "class Stack:\n    def __init__(self):\n",
    "KING LEAR. Blow, winds, and crack your cheeks!\n",
    ":help motion.txt\n\nThe motion commands",
    "for i in range(10):\n",
    "MACBETH. Is this a dagger which I see before me,\n",
    "def quicksort(items):\n",
    "*usr_02.txt*\tFor Vim version 9.0.\n\n",
    "OTHELLO. It is the cause, it is the cause, my soul.\n",
    "def read_lines(path):\n    with open(path) as f:\n",
    "PROSPERO. We are such stuff as dreams are made on,\n",
    "while True:\n    line = input()\n",
]
MODEL_ID = "bench"
PROBE_EVERY = 0.1  # seconds between responsiveness probes


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    n_chunks, usage = 0, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            if data.get("choices") and data["choices"][0].get("text"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                n_chunks += 1
    n_tokens = usage["completion_tokens"] if usage else n_chunks
    if first is None or last is None:
        return {"tokens": n_tokens, "ttft": time.perf_counter() - t0, "itl": float("nan")}
    itl = (last - first) / (n_tokens - 1) if n_tokens > 1 else float("nan")
    return {"tokens": n_tokens, "ttft": first - t0, "itl": itl}


async def load(url: str, n_clients: int, n_requests: int, max_tokens: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, PROMPTS[0], 4)  # warm-up

        async def run_client(i: int) -> list[dict[str, float]]:
            out = []
            for k in range(n_requests):
                try:
                    out.append(await one_request(client, url, PROMPTS[(i + k * n_clients) % len(PROMPTS)], max_tokens))
                except httpx.HTTPError:
                    out.append({"tokens": 0, "ttft": float("nan"), "itl": float("nan"), "failed": 1})
            return out

        done = asyncio.Event()
        probes: list[float] = []
        probing = asyncio.create_task(probe(client, url, done, probes))
        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(run_client(i) for i in range(n_clients)))
        wall = time.perf_counter() - t0
        done.set()
        await probing
    failed = sum(r.get("failed", 0) for rs in per_client for r in rs)
    results = [r for rs in per_client for r in rs if not r.get("failed")] or [{"tokens": 0, "ttft": 0, "itl": 0}]
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    itl = [r["itl"] for r in results if r["itl"] == r["itl"]]
    return {
        "clients": n_clients, "requests": n_clients * n_requests, "failed": failed, "tokens": tokens,
        "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2), "mean_tokens": round(tokens / len(results), 1),
        "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1),
        "itl_p50_ms": round(1000 * percentile(itl, 50), 2), "itl_p99_ms": round(1000 * percentile(itl, 99), 2),
        "http_p50_ms": round(1000 * percentile(probes, 50), 1), "http_p99_ms": round(1000 * percentile(probes, 99), 1),
    }  # fmt: skip


async def probe(client: httpx.AsyncClient, url: str, done: asyncio.Event, out: list[float]) -> None:
    """How long `GET /v1/models` takes while the clients stream, every PROBE_EVERY seconds until `done`: whether the
    server's HTTP side stays responsive while it decodes."""
    while not done.is_set():
        t0 = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            (await client.get(f"{url}/v1/models")).raise_for_status()
            out.append(time.perf_counter() - t0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), PROBE_EVERY)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} not ready after {timeout} s")


def moelane_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "moelane", "serve", "--port", str(port), "--served-model-name", MODEL_ID,
           "--drafter", args.drafter, "--max-streams", "16", "--log-level", "warning"]  # fmt: skip
    return cmd + (["--model", args.model] if args.model else []) + args.moelane_arg


def llama_command(args: argparse.Namespace, port: int, gguf: Path) -> list[str]:
    return [args.llama_python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", MODEL_ID,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--type_k", "0", "--type_v", "0",
            "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
            "--interrupt_requests", "False"]  # queue concurrent requests, do not cancel the running one  # fmt: skip


def to_gguf(args: argparse.Namespace, out_dir: Path) -> Path:
    if args.gguf:
        return Path(args.gguf)
    if not args.llama_cpp:
        raise SystemExit("give --gguf FILE or --llama-cpp DIR (llama.cpp tree with convert_hf_to_gguf.py)")
    folder = args.model or str(Path(__import__("moelane.assets", fromlist=["x"]).default_model_path()))
    return llama_gguf.convert(Path(folder), out_dir / "model-f32.gguf", Path(args.llama_cpp))


class Server:
    """A server subprocess on a loopback port, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, args: argparse.Namespace) -> None:
        self.name, self.cmd, self.url, self.args = name, cmd, f"http://127.0.0.1:{port}", args
        self.log_path = Path(tempfile.gettempdir()) / f"serve_bench_{port}.log"

    def __enter__(self) -> Server:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.threads)}
        if self.name == "moelane" and self.args.moelane_threads:  # its own choice: serve's default unless given
            env.pop("OMP_NUM_THREADS")
            if self.args.moelane_threads != "default":
                env["OMP_NUM_THREADS"] = self.args.moelane_threads
        self.log = open(self.log_path, "wb")  # closed in __exit__
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_ready(self.url, self.proc, self.args.startup_timeout)
        except RuntimeError as e:
            self.__exit__()
            raise RuntimeError(f"{self.name}: {e}; see {self.log_path}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def measure(servers: list[Server], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both servers up at once (the idle one takes no CPU), measured in turn at each client count, so a change in
    the machine's load during the run hits both alike; with `--repeat`, each round goes over every cell again with
    the servers' order swapped."""
    rows = []
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        for server in servers:  # steady state first: both servers serve the same unrecorded load
            if args.warmup:
                asyncio.run(load(server.url, 4, -(-args.warmup // 4), args.max_tokens))
        for rnd in range(args.repeat):
            for n in args.clients:
                for server in servers if rnd % 2 == 0 else servers[::-1]:
                    result = asyncio.run(load(server.url, n, args.requests, args.max_tokens))
                    row = {"server": server.name, "round": rnd, **result}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def ratio(ours: float, theirs: float) -> float | None:
    """ours / theirs, or None where the other server produced no tokens (nothing to compare with)."""
    return round(ours / theirs, 2) if theirs else None


def summarize(results: list[dict[str, Any]], clients: list[int]) -> dict[str, Any]:
    """Per client count: median tok/s of each server over the rounds, the ratio of medians, and the per-round
    ratios (their spread says how much the machine moved during the run)."""
    summary: dict[str, Any] = {"summary": True}
    for n in clients:
        ours = [r["tok_s"] for r in results if r["server"] == "moelane" and r["clients"] == n]
        theirs = [r["tok_s"] for r in results if r["server"] != "moelane" and r["clients"] == n]
        summary[f"moelane_tok_s_{n}"] = round(statistics.median(ours), 1)
        if theirs:
            summary[f"llama_tok_s_{n}"] = round(statistics.median(theirs), 1)
            summary[f"tok_s_ratio_{n}"] = ratio(statistics.median(ours), statistics.median(theirs))
            summary[f"round_ratios_{n}"] = [ratio(a, b) for a, b in zip(ours, theirs, strict=True)]
    ratios = [v for k, v in summary.items() if k.startswith("tok_s_ratio") and v is not None]
    summary["median_ratio"] = statistics.median(ratios) if ratios else None
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: the shipped default model)")
    p.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=2, help="requests per client (default 2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over every (clients, server) cell, the servers' order swapped each round; the "
                   "summary gives medians")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=16, help="unrecorded full-length requests per server first")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    p.add_argument("--moelane-threads", default="default",
                   help="moelane's compute threads: 'default' (serve's own: every core), or N; "
                   "empty: the same as --threads")  # fmt: skip
    p.add_argument("--drafter", default="none", help="moelane serve --drafter (default none)")
    p.add_argument("--moelane-arg", action="append", default=[], help="extra argument for moelane serve")
    p.add_argument("--llama-python", help="python with llama-cpp-python[server] (omit: moelane only)")
    p.add_argument("--llama-cpp", help="llama.cpp tree to convert the model with")
    p.add_argument("--gguf", help="the model as GGUF already")
    p.add_argument("--port", type=int, default=8311)
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args()
    config = {k: v for k, v in vars(args).items() if k not in ("llama_python",)}
    print(json.dumps({"bench": "serve", "git": git_rev(), **config}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        servers = [Server("moelane", moelane_command(args, args.port), args.port, args)]
        if args.llama_python:
            gguf = to_gguf(args, Path(tmp))
            servers.append(Server("llama_cpp.server", llama_command(args, args.port + 1, gguf), args.port + 1, args))
        results = measure(servers, args)
    print(json.dumps(summarize(results, args.clients)), flush=True)


if __name__ == "__main__":
    main()
