"""moelane.kernels' gather_linear: ms per MoE layer and GB/s of distinct experts' bytes, against this machine's read
bandwidth (median `x.sum()` over a 1 GB fp32 tensor at the same thread count).

One MoE layer = the w13 product of every (token, expert) pair, SwiGLU in torch, the w2 product. Shapes:
- inflated: H 192, I 8192 (w13 [16384, 192], w2 [192, 8192]), 32 experts, top-4 (8 rows touch ~21 experts);
- qwen3-30b-a3b: H 2048, I 768, 128 experts, top-8.
Dense: LM heads [8192, 192] and [151936, 2048] at 1 row (`linear`), and the per-call cost of `linear` against
`gather_linear` with index tensors built for a tiny 1-row product.

Weights come from memory, not cache: each kind's pools are random codes / values (speed does not depend on them)
spanning >= 1.5 GB, and every call takes the experts next in a round-robin over all layers' pools (a random top-k
routing, renamed onto them), so an expert is touched again only after the whole span. Timings are medians.

This 2-core machine is shared: run it as `/work/scratch/kernels/prio.sh python bench/kernel_bench.py` (its own
autogroup at nice -20); each JSON line carries the 1-minute load average, and figures taken under load are lower
bounds. Prints one JSON line per measurement (config, git revision), then a summary table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelane import kernels
from moelane.kernels import hugepages
from revision import git_rev

SPAN_BYTES = 1.5e9
MOST_CALLS = 400


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    width: int
    n_experts: int
    top_k: int
    head: tuple[int, int]  # LM head [vocab, hidden]


SHAPES = {
    "inflated": Shape(192, 8192, 32, 4, (8192, 192)),
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8, (151936, 2048)),
}


def random_pool(kind: str, n_slots: int, n_out: int, n_in: int, g: torch.Generator) -> kernels.Pool:
    """A pool of random values (floats) or random codes and scales (int8 / int4), built without quantising, in
    huge-page memory as the engine's resident pools are (`moelane.kernels.hugepages`)."""
    if kind in ("f32", "bf16"):
        values = (torch.randn(n_slots, n_out, n_in, generator=g) * 0.05).to(kernels.pool.DTYPES[kind])
        return kernels.Pool(kind, hugepages.place(values))
    fmt = kernels.pool.QUANT[kind]
    cols = kernels.pool.padded_cols(n_in, fmt)
    scales = (torch.rand(n_slots, n_out, fmt.n_groups(n_in), generator=g) * 0.01).half()
    if kind == "int8":
        return kernels.Pool(
            kind, hugepages.place(torch.randint(-127, 128, (n_slots, n_out, cols), generator=g, dtype=torch.int8)),
            scales, n_in,
        )  # fmt: skip
    return kernels.Pool(
        kind, hugepages.place(torch.randint(0, 256, (n_slots, n_out, cols // 2), generator=g, dtype=torch.uint8)),
        scales, n_in,
    )  # fmt: skip


def timed(call: Callable[[int], object], budget_s: float, least: int = 20, most: int = MOST_CALLS) -> float:
    """Median seconds of call(i) for i = 0, 1, ...: at least `least` calls, more until `budget_s` has passed."""
    for i in range(3):
        call(i)
    times: list[float] = []
    start = time.perf_counter()
    i = 3
    while len(times) < least or (time.perf_counter() - start < budget_s and len(times) < most):
        t = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - t)
        i += 1
    return statistics.median(times)


def read_bandwidth() -> float:
    """GB/s of `x.sum()` over a 1 GB float32 tensor at the current thread count, in huge-page memory as the pools."""
    x = hugepages.empty((2**28,), torch.float32).fill_(1.0)
    return 2**30 / timed(lambda i: x.sum(), 0.0, least=7) / 1e9


def plan_calls(
    shape: Shape, n_rows: int, n_calls: int, n_layers: int, g: torch.Generator
) -> list[tuple[int, torch.Tensor, int]]:
    """Per call: (layer, slots [T * K], distinct count). Each call routes n_rows tokens by a random top-k, its
    distinct experts renamed onto the next ids of a round-robin over all layers' slots (a call stays in one layer)."""
    out, next_id = [], 0
    for _ in range(n_calls):
        ids = torch.randn(n_rows, shape.n_experts, generator=g).topk(shape.top_k, dim=-1).indices.flatten()
        distinct, renamed = torch.unique(ids, return_inverse=True)
        n = distinct.numel()
        if next_id % shape.n_experts + n > shape.n_experts:
            next_id += shape.n_experts - next_id % shape.n_experts
        out.append(((next_id // shape.n_experts) % n_layers, renamed + next_id % shape.n_experts, n))
        next_id += n
    return out


def moe_layer(shape: Shape, kind: str, n_rows: int, budget_s: float, g: torch.Generator) -> dict[str, float]:
    w13 = random_pool(kind, shape.n_experts, 2 * shape.width, shape.hidden, g)
    w2 = random_pool(kind, shape.n_experts, shape.hidden, shape.width, g)
    expert_bytes = w13.nbytes + w2.nbytes
    n_layers = max(1, math.ceil(SPAN_BYTES / (expert_bytes * shape.n_experts)))
    layers = [(w13, w2)] + [
        (
            random_pool(kind, shape.n_experts, 2 * shape.width, shape.hidden, g),
            random_pool(kind, shape.n_experts, shape.hidden, shape.width, g),
        )
        for _ in range(n_layers - 1)
    ]
    plan = plan_calls(shape, n_rows, MOST_CALLS + 3, n_layers, g)
    x = torch.randn(n_rows, shape.hidden, generator=g)
    rows = torch.arange(n_rows).repeat_interleave(shape.top_k)
    pairs = torch.arange(n_rows * shape.top_k)

    def call(i: int) -> torch.Tensor:
        layer, slots, _ = plan[i % len(plan)]
        a, b = layers[layer]
        gate_up = kernels.gather_linear(x, rows, slots, a)
        h = F.silu(gate_up[:, : shape.width]) * gate_up[:, shape.width :]
        return kernels.gather_linear(h, pairs, slots, b)

    seconds = timed(call, budget_s)
    distinct = statistics.mean(n for _, _, n in plan)
    return {
        "ms": seconds * 1e3,
        "GBps": distinct * expert_bytes / seconds / 1e9,
        "distinct": distinct,
        "span_GB": n_layers * shape.n_experts * expert_bytes / 1e9,
    }


def dense_head(shape: Shape, kind: str, budget_s: float, g: torch.Generator) -> dict[str, float]:
    vocab, hidden = shape.head
    one = random_pool(kind, 1, vocab, hidden, g)
    copies = max(1, math.ceil(SPAN_BYTES / one.nbytes))
    big = random_pool(kind, copies, vocab, hidden, g) if copies > 1 else one
    heads = [
        kernels.Pool(kind, big.data[i : i + 1], None if big.scales is None else big.scales[i : i + 1], big.in_features)
        for i in range(copies)
    ]
    x = torch.randn(1, hidden, generator=g)
    seconds = timed(lambda i: kernels.linear(x, heads[i % copies]), budget_s)
    rec = {"ms": seconds * 1e3, "GBps": one.nbytes / seconds / 1e9}
    if kind in ("f32", "bf16"):  # torch's own dense product, for scale (bf16: x cast to bf16)
        dense = [h.data[0] for h in heads]
        xt = x.to(dense[0].dtype)
        torch_s = timed(lambda i: F.linear(xt, dense[i % copies]), budget_s)
        rec["torch_ms"] = torch_s * 1e3
    return rec


def call_overhead() -> dict[str, float]:
    """us per 1-row product of a cache-hot [192, 192] f32 matrix: `linear`, `gather_linear` with index tensors built
    per call, and torch's F.linear."""
    pool = kernels.quantize(torch.randn(1, 192, 192), "f32")
    x = torch.randn(1, 192)
    n = 20000

    def per_call(f: Callable[[], object]) -> float:
        for _ in range(200):
            f()
        t = time.perf_counter()
        for _ in range(n):
            f()
        return (time.perf_counter() - t) / n * 1e6

    return {
        "linear_us": per_call(lambda: kernels.linear(x, pool)),
        "gather_with_index_tensors_us": per_call(
            lambda: kernels.gather_linear(x, torch.arange(1), torch.zeros(1, dtype=torch.int64), pool)
        ),
        "torch_linear_us": per_call(lambda: F.linear(x, pool.data[0])),
    }


def emit(rec: dict[str, object]) -> dict[str, object]:
    rec = {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}
    rec["load1"] = round(os.getloadavg()[0], 2)
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kinds", default=",".join(kernels.KINDS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds of timed calls per figure (at least 20)")
    ap.add_argument("--no-dense", action="store_true")
    args = ap.parse_args()
    found = kernels.ensure_built()
    base = {"bench": "kernel", "git": git_rev(), "backend": found.backend, "torch": torch.__version__}
    emit({**base, "what": "config", "cpu_count": os.cpu_count()})
    records = []
    g = torch.Generator().manual_seed(0)
    for n_threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(n_threads)
        bw = read_bandwidth()
        records.append(emit({**base, "what": "read_bandwidth", "threads": n_threads, "GBps": bw}))
        records.append(emit({**base, "what": "overhead", "threads": n_threads, **call_overhead()}))
        for name in args.shapes.split(","):
            for kind in args.kinds.split(","):
                for n_rows in (int(r) for r in args.rows.split(",")):
                    rec = moe_layer(SHAPES[name], kind, n_rows, args.budget, g)
                    records.append(
                        emit(
                            {
                                **base,
                                "what": "moe_layer",
                                "shape": name,
                                "kind": kind,
                                "rows": n_rows,
                                "threads": n_threads,
                                **rec,
                                "of_read_bw": rec["GBps"] / bw,
                            }
                        )
                    )
                if not args.no_dense:
                    rec = dense_head(SHAPES[name], kind, args.budget, g)
                    records.append(
                        emit(
                            {
                                **base,
                                "what": "lm_head",
                                "shape": name,
                                "kind": kind,
                                "rows": 1,
                                "threads": n_threads,
                                **rec,
                                "of_read_bw": rec["GBps"] / bw,
                            }
                        )
                    )
    print_table(records)


def print_table(records: list[dict[str, object]]) -> None:
    print(
        f"\n{'what':9} {'shape':14} {'kind':5} {'thr':>3} {'rows':>4} {'ms':>8} {'GB/s':>6} {'of bw':>6} "
        f"{'torch ms':>8} {'load':>5}"
    )
    for r in records:
        if r["what"] in ("moe_layer", "lm_head"):
            torch_ms = f"{r['torch_ms']:8.3f}" if "torch_ms" in r else " " * 8
            print(
                f"{r['what']:9} {r['shape']:14} {r['kind']:5} {r['threads']:>3} {r['rows']:>4} {r['ms']:8.3f} "
                f"{r['GBps']:6.1f} {r['of_read_bw']:6.2f} {torch_ms} {r['load1']:5.2f}"
            )
        elif r["what"] == "read_bandwidth":
            print(f"read bandwidth at {r['threads']} thread(s): {r['GBps']:.1f} GB/s (load {r['load1']})")


if __name__ == "__main__":
    main()
