"""Two ranks on one machine against one process with the same memory, and against every expert resident.

Configurations, each a fresh launch on `--model` after the page cache is dropped (root: /proc/sys/vm/drop_caches; a
run that cannot drop it, or is told not to, says so in every record):

    spread    torchrun, 2 ranks on this machine: each rank holds its half of every MoE layer's experts, all resident
              (a rank is allowed half of all experts' bytes: its whole share)
    paged     one process, --expert-memory 50%: the same bytes of experts as one rank, paging the other half from disk
    resident  one process, every expert resident (the ceiling)

In each launch, one warm-up pass of the lanes engine at the largest stream count, then each of `--streams` (N greedy
streams of `--tokens` tokens through the lanes engine, as `moelane bench --streams N`; eager, as a distributed run
is). Configurations alternate within a round (their order turns by one each round); medians over `--rounds`.

Per cell: aggregate tok/s; the exchange's share of the cell (rank 0's seconds in the exchange's collectives over the
cell's seconds); each process's CPU seconds (user + system) over the cell (the ranks' own, gathered by rank 0 in one
collective, `moelane.dist.counters`), since two ranks on a 2-core machine share its cores. Prints one JSON line per
cell, then a summary line: medians and the ratios spread / paged and spread / resident per stream count.

    sudo .venv/bin/python bench/dist_bench.py --model /work/scratch/inflated-8192 --tokens 64 --rounds 3

`worker CONFIG ...` is one launch's process (rank), started by the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from revision import git_rev

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("spread", "paged", "resident")


# ---- one launch (a rank, or the one process) -----------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch

    import moelane

    torch.set_num_threads(args.threads)
    dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.config != "spread":
        memory = "50%" if args.config == "paged" else None
        lm = moelane.load(args.model, dtype, expert_memory=memory)
        try:
            emit_cells(lm, args, snapshot_process)
        finally:
            lm.close()
        return
    from moelane import dist

    ranks = dist.join(args.dist_timeout)
    try:
        if ranks.rank != 0:
            dist.serve_experts(ranks, args.model, dtype)
            return
        lm = dist.load(ranks, args.model, dtype)
        try:
            emit_cells(lm, args, snapshot_ranks)
        finally:
            lm.close()
    finally:
        ranks.close()


def snapshot_process(lm: Any) -> dict[str, Any]:
    cpu = os.times()
    return {"cpu_s": [cpu.user + cpu.system], "exchange_s": 0.0, "held": None}


def snapshot_ranks(lm: Any) -> dict[str, Any]:
    counts = lm.provider.rank_counts()
    return {"cpu_s": [c.user_s + c.system_s for c in counts], "exchange_s": lm.provider.stats.exchange_s,
            "held": [[c.experts, c.resident] for c in counts]}  # fmt: skip


def emit_cells(lm: Any, args: argparse.Namespace, snapshot: Any) -> None:
    """The warm-up, then one JSON line per stream count on stdout."""
    from moelane.commands.bench import many_streams
    from moelane.lanes.config import EngineConfig

    streams = [int(n) for n in args.streams.split(",")]

    def engine(n: int) -> Any:
        return EngineConfig(drafter="none", max_streams=n)

    many_streams(lm, max(streams), min(args.tokens, 16), engine(max(streams)))  # warm-up
    for n in streams:
        before, start = snapshot(lm), time.perf_counter()
        result = many_streams(lm, n, args.tokens, engine(n))
        seconds, after = time.perf_counter() - start, snapshot(lm)
        cpu = [round(b - a, 3) for a, b in zip(before["cpu_s"], after["cpu_s"], strict=True)]
        share = (after["exchange_s"] - before["exchange_s"]) / seconds
        print(json.dumps({"cell": True, "streams": n, "tok_s": round(result["aggregate_tok_s"], 2),
                          "seconds": round(seconds, 3), "exchange_share": round(share, 4), "cpu_s": cpu,
                          "held": after["held"]}), flush=True)  # fmt: skip


# ---- the benchmark ----------------------------------------------------------------------------------------------


def drop_caches() -> bool:
    """Drop the page cache (root only); whether it was."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: argparse.Namespace, config: str) -> list[dict[str, Any]]:
    """One launch of `config` -> its cells (rank 0's lines)."""
    common = ["worker", "--config", config, "--dtype", args.dtype, "--tokens", str(args.tokens), "--streams",
              args.streams, "--dist-timeout", str(args.dist_timeout)]  # fmt: skip
    if args.model is not None:
        common += ["--model", str(args.model)]
    me = str(Path(__file__).resolve())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    if config == "spread":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), me, *common, "--threads",
                   str(args.rank_threads)]  # fmt: skip
    else:
        command = [sys.executable, me, *common, "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.launch_timeout)
    cells = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"cell"')]
    if done.returncode != 0 or not cells:
        raise SystemExit(f"{config} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return cells


def run(args: argparse.Namespace) -> None:
    rev = git_rev(ROOT)
    records: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
        for config in order:
            dropped = not args.keep_caches and drop_caches()
            for cell in launch(args, config):
                record = {"round": r, "config": config, "caches_dropped": dropped, **cell}
                record.pop("cell")
                records.append(record)
                print(json.dumps(record), flush=True)
    print(json.dumps(summary(args, records, rev)), flush=True)


def summary(args: argparse.Namespace, records: list[dict[str, Any]], rev: str) -> dict[str, Any]:
    """Medians per (config, streams), and the ratios of the spread run's tok/s to the others'."""
    out: dict[str, Any] = {"summary": True, "git": rev, "model": str(args.model or "shipped"), "tokens": args.tokens,
                           "rounds": args.rounds, "threads": args.threads, "rank_threads": args.rank_threads,
                           "cores": os.cpu_count()}  # fmt: skip
    for n in sorted({rec["streams"] for rec in records}):
        cells = {c: [rec for rec in records if rec["config"] == c and rec["streams"] == n] for c in CONFIGS}
        med = {c: {"tok_s": median(cs, lambda rec: rec["tok_s"]),
                   "exchange_share": median(cs, lambda rec: rec["exchange_share"]),
                   "cpu_s": [round(statistics.median(rec["cpu_s"][i] for rec in cs), 3)
                             for i in range(len(cs[0]["cpu_s"]))]}
               for c, cs in cells.items() if cs}  # fmt: skip
        tok = {c: m["tok_s"] for c, m in med.items()}
        out[f"streams_{n}"] = {**med, "spread_over_paged": ratio(tok.get("spread"), tok.get("paged")),
                               "spread_over_resident": ratio(tok.get("spread"), tok.get("resident"))}  # fmt: skip
    return out


def median(records: list[dict[str, Any]], key: Any) -> float:
    return round(statistics.median(key(rec) for rec in records), 4)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=("bench", "worker"), default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="model folder (default: the shipped model)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    ap.add_argument("--streams", default="1,8", help="stream counts, comma-separated (default 1,8)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each configuration once a round (default 3)")
    cores = os.cpu_count() or 1
    ap.add_argument("--threads", type=int, default=cores, help=f"one process's threads (default {cores})")
    ap.add_argument("--rank-threads", type=int, default=max(1, cores // 2),
                    help=f"each rank's threads (default {max(1, cores // 2)}: the cores shared)")  # fmt: skip
    ap.add_argument("--dist-timeout", type=float, default=300.0, help="the ranks' --dist-timeout (default 300 s)")
    ap.add_argument("--launch-timeout", type=float, default=3600.0, help="seconds one launch may take")
    ap.add_argument("--keep-caches", action="store_true",
                    help="do not drop the page cache (a check of the script beside other work; paged then may read "
                    "from memory)")  # fmt: skip
    return ap.parse_args(argv)


if __name__ == "__main__":
    parsed = parse(sys.argv[1:])
    if parsed.mode == "worker":
        worker(parsed)
    else:
        run(parsed)
