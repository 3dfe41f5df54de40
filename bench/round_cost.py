"""A round's measured time against the time its weight reads take at the measured bandwidth.

For each stream count (default 1, 2, 4, 8, 16), an engine serves that many plain greedy streams (open prompts) on
the model, as `moelane serve` does (the decode step compiled unless `--eager`), and every decode round that holds
all of them is timed (the target's forward pass, as the engine calls it). Its bound is

    (dense bytes + one expert's bytes at its tier x the distinct experts its MoE layers route to) / bandwidth

(`moelane.model.footprint`), the bandwidth measured in this process with the same threads: the fastest of several
sums over 1 GiB of float32, before the rounds and after each stream count's (the summary lists each: on a shared VM
it wanders within minutes, and the fastest is the bound). Each round is also set against the bandwidth of its moment
(`paired`): every `--sum-every` rounds the pass waits for two more sums (untimed), and the rounds until the next
sample take their fastest; this VM's bandwidth jumped between ~34 and ~72 GB/s within the hour, and the paired ratio
tells the rounds' own cost from where the machine stood. The distinct experts of a round are counted afterwards,
from one eager pass over each stream's whole sequence with a routing observer (an observer would make the timed
rounds eager), each round's rows looked up at their positions. Prints the bandwidth, then per stream count the median
round time, the median bound and the median of the rounds' ratios, with the experts per layer, and the median time
from one pass to the next (the engine's whole round: sampling, commits, choosing the next rows); a summary line with
the worst ratio. `--profile N` then runs N streams under torch.profiler and prints where the time goes.

    python bench/round_cost.py --model /path/inflated-8192 --threads 2
    python bench/round_cost.py --model /path/inflated-8192 --default-tier int8 --quantize int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moelane
from lanes_bench import prompts
from moelane.kernels import hugepages
from moelane.lanes import Engine, EngineConfig
from moelane.model.cache import Rows
from moelane.model.footprint import footprint
from moelane.model.lm import STEP_POOLS
from moelane.model.provider import RoutingRecord
from revision import git_rev

GiB = 1 << 30


class Meter:
    """Read bandwidth of the moment: bytes per second of the fastest of some sums over 1 GiB of float32, in the
    memory the resident weights live in (huge pages where the system has them: `moelane.kernels.hugepages`; on 4 KiB
    pages the same sum reads ~20% slower here, which would loosen the bound). One buffer for the whole run."""

    def __init__(self) -> None:
        self.x = hugepages.empty((GiB // 4,), torch.float32).fill_(1.0)
        self.x.sum()

    def __call__(self, repeats: int = 7) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.x.sum()
            best = min(best, time.perf_counter() - t0)
        return GiB / best


def timed_rounds(
    lm: Any, n: int, tokens: int, meter: Meter | None = None, every: int = 0
) -> tuple[list[dict[str, Any]], dict[int, list[int]]]:
    """Serve `n` streams; each decode round holding all of them -> {seconds, rows: [(stream id, start, n)], step,
    bw}, and each stream's whole sequence (prompt and reply) by id. With `meter`, every `every` passes first sample
    the bandwidth (untimed, left out of `step` too); `bw` is the latest sample before the round."""
    engine = Engine(lm, EngineConfig(drafter="none", timed=False))
    forward, rounds, last, bw, count = engine._forward, [], [0.0], [0.0], [0]

    def timed(windows: list[Any]) -> Any:
        rows = [(w.lane.stream.id, w.lane.n_fed, len(w.feed) + len(w.drafts)) for w in windows]
        if meter is not None and every and count[0] % every == 0:
            t = time.perf_counter()
            bw[0] = meter(2)
            last[0] += time.perf_counter() - t
        count[0] += 1
        t0 = time.perf_counter()
        out = forward(windows)
        seconds = time.perf_counter() - t0
        if len(windows) == n and not any(w.lane.prefilling for w in windows):
            # (step: from the previous pass's start, less the bandwidth samples between)
            rounds.append({"seconds": seconds, "rows": rows, "step": t0 - last[0], "bw": bw[0]})
        last[0] = t0
        return out

    engine._forward = timed  # type: ignore[method-assign]
    streams = [engine.submit(p, max_tokens=tokens, stop_token_ids=None) for p in prompts(lm.tokenizer, "open", n)]
    engine.run_until_idle()
    return rounds, {s.id: s.prompt_ids + list(s.token_ids) for s in streams}


def routing(lm: Any, sequence: list[int]) -> torch.Tensor:
    """Expert ids [L, T, K] of an eager pass over a whole sequence."""
    records: list[RoutingRecord] = []

    class Recorder:
        def observe(self, record: RoutingRecord) -> None:
            records.append(record)

    lm.observers.append(Recorder())
    try:
        lm.forward([Rows(lm.cache_for(len(sequence), 0), sequence, 0)])
    finally:
        lm.observers.pop()
    return torch.cat([r.expert_ids for r in records], dim=1)


def distinct(ids: dict[int, torch.Tensor], rows: list[tuple[int, int, int]]) -> list[int]:
    """Distinct experts per MoE layer that a round's rows route to."""
    picked = torch.cat([ids[s][:, start : start + k].flatten(1) for s, start, k in rows], dim=1)  # [L, rows * K]
    return [len(set(layer.tolist())) for layer in picked]


def profile(lm: Any, n: int, tokens: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_rounds(lm, n, tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the shipped model)")
    ap.add_argument("--streams", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=48, help="reply tokens per stream")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--eager", action="store_true", help="do not compile the decode step")
    ap.add_argument("--default-tier", default="native", choices=("native", "int8", "int4"))
    ap.add_argument("--quantize", default="none", choices=("none", "int8", "int4"))
    ap.add_argument("--sum-every", type=int, default=8, metavar="K",
                    help="sample the bandwidth every K passes, for the paired ratios (0: not)")  # fmt: skip
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then profile N streams")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = moelane.load(args.model, "auto", default_tier=args.default_tier, quantize=args.quantize)
    if not args.eager:
        lm.enable_compile()
        lm.warm_up(1, 1, STEP_POOLS)  # (as `moelane serve`: rounds of two cache capacities share a call)
    shape = footprint(lm)
    if shape is None:
        raise SystemExit("round_cost needs a model with routed experts")
    timed_rounds(lm, 2, 8)  # warm up (first passes, allocations, the step's graph at a few row counts)
    meter = Meter()
    bw = meter()
    print(json.dumps({
        "bench": "round_cost", "git": git_rev(), **vars(args), "torch_threads": torch.get_num_threads(),
        "compiled": lm.compiled, "dense_MB": round(shape.dense / 1e6, 2), "expert_MB": round(shape.expert / 1e6, 3),
        "bandwidth_GBs": round(bw / 1e9, 2),
    }), flush=True)  # fmt: skip
    results, sums = [], [bw]
    for n in map(int, args.streams.split(",")):
        rounds, sequences = timed_rounds(lm, n, args.tokens, meter, args.sum_every)
        sums.append(meter())  # (after every stream count: this machine's bandwidth wanders within minutes)
        ids = {s: routing(lm, seq) for s, seq in sequences.items()}
        for r in rounds:
            r["distinct"] = distinct(ids, r["rows"])
        results.append((n, rounds))
    bw = max(sums)
    worst, worst_paired = 0.0, 0.0
    for n, rounds in results:
        ms = [1e3 * r["seconds"] for r in rounds]
        bound = [1e3 * shape.pass_bytes(sum(r["distinct"])) / bw for r in rounds]
        ratio = statistics.median(m / b for m, b in zip(ms, bound, strict=True))
        worst = max(worst, ratio)
        paired = {}
        if all(r["bw"] for r in rounds):
            now = [r["bw"] for r in rounds]
            # (a round's bound at its moment's bandwidth: its bound at the fastest sum x fastest / its moment's)
            paired_ratio = statistics.median(m / (b * bw / r) for m, b, r in zip(ms, bound, now, strict=True))
            worst_paired = max(worst_paired, paired_ratio)
            paired = {"paired_GBs": round(statistics.median(now) / 1e9, 1), "paired_ratio": round(paired_ratio, 2)}
        print(json.dumps({
            "streams": n, "rounds": len(rounds),
            "experts_per_layer": round(statistics.mean(statistics.mean(r["distinct"]) for r in rounds), 1),
            "MB_per_round": round(statistics.median(shape.pass_bytes(sum(r["distinct"])) for r in rounds) / 1e6, 1),
            "round_ms": round(statistics.median(ms), 2), "bound_ms": round(statistics.median(bound), 2),
            "step_ms": round(1e3 * statistics.median(r["step"] for r in rounds[1:] or rounds), 2),
            "ratio": round(ratio, 2), **paired,
        }), flush=True)  # fmt: skip
    print(json.dumps({"summary": True, "bandwidth_GBs": round(bw / 1e9, 2),
                      "sums_GBs": [round(b / 1e9, 1) for b in sums], "worst_ratio": round(worst, 2),
                      "worst_paired_ratio": round(worst_paired, 2) if worst_paired else None,
                      "target": 1.3, "met": worst <= 1.3,
                      "met_paired": worst_paired <= 1.3 if worst_paired else None}), flush=True)  # fmt: skip
    if args.profile:
        profile(lm, args.profile, args.tokens)


if __name__ == "__main__":
    main()
