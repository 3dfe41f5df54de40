"""Huge pages against ordinary pages for streamed weights (`moelane.kernels.hugepages`): one MoE layer per call (the
w13 product of every (token, expert) pair, SwiGLU, the w2 product, as bench/kernel_bench.py), the same random
pools twice, once in huge-page-advised memory and once copied to ordinary memory, each spanning --span-gb so that
calls stream from memory; the two timed in alternated rounds in one process, medians.

    python bench/pages_ab.py --kinds int8,bf16 --rows 1,4,16

Prints one JSON line per (kind, rows): each side's ms per layer and huge pages' speed over ordinary pages'.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import kernel_bench as kb

from moelane import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="inflated", choices=kb.SHAPES)
    ap.add_argument("--kinds", default="int8,bf16")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per round and side")
    ap.add_argument("--span-gb", type=float, default=1.2, help="each side's pools (both are held at once)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape, g = kb.SHAPES[args.shape], torch.Generator().manual_seed(0)
    for kind in args.kinds.split(","):
        expert = (kb.random_pool(kind, 1, 2 * shape.width, shape.hidden, g).nbytes
                  + kb.random_pool(kind, 1, shape.hidden, shape.width, g).nbytes)  # fmt: skip
        n_layers = max(1, math.ceil(args.span_gb * 1e9 / (expert * shape.n_experts)))
        huge = [(kb.random_pool(kind, shape.n_experts, 2 * shape.width, shape.hidden, g),
                 kb.random_pool(kind, shape.n_experts, shape.hidden, shape.width, g))
                for _ in range(n_layers)]  # fmt: skip

        def ordinary(p: kernels.Pool) -> kernels.Pool:
            return kernels.Pool(p.kind, p.data.clone(), p.scales, p.in_features)  # (clone: torch's own memory)

        sides = {"ordinary": [(ordinary(a), ordinary(b)) for a, b in huge], "huge": huge}
        for n_rows in map(int, args.rows.split(",")):
            plan = kb.plan_calls(shape, n_rows, 1000, n_layers, g)
            x = torch.randn(n_rows, shape.hidden, generator=g)
            rows, pairs = torch.arange(n_rows).repeat_interleave(shape.top_k), torch.arange(n_rows * shape.top_k)
            times: dict[str, list[float]] = {name: [] for name in sides}
            i = 0
            for r in range(args.rounds):
                for name in sorted(sides, reverse=r % 2 == 1):
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        layer, slots, _ = plan[i % len(plan)]
                        a, b = sides[name][layer]
                        gate_up = kernels.gather_linear(x, rows, slots, a)
                        h = F.silu(gate_up[:, : shape.width]) * gate_up[:, shape.width :]
                        kernels.gather_linear(h, pairs, slots, b)
                        i += 1
                    times[name].append((time.perf_counter() - t0) / args.calls)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            print(json.dumps({"bench": "pages_ab", "git": kb.git_rev(), "shape": args.shape, "kind": kind,
                              "rows": n_rows, "threads": args.threads, "ordinary_ms": round(ms["ordinary"], 3),
                              "huge_ms": round(ms["huge"], 3), "huge_speedup": round(ms["ordinary"] / ms["huge"], 3)}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
