"""A/B of two revisions of gather_linear's C++ kernels in one process: each revision's `kernels/csrc/` is compiled as
its own extension (a git revision, `WORKTREE` for the files as they are, or a folder of .cpp / .h files; revisions
that register torch.ops.<name>, as kernels/build.py loads them, i.e. from the commit that dropped pybind11), and both
are timed on the same weights in alternated rounds (A B, B A, ...), medians of the rounds. Two measurements:

- layer: one MoE layer per call (the w13 product of every (token, expert) pair, SwiGLU, the w2 product, as
  bench/kernel_bench.py), weights streamed from memory (pools spanning --span-gb, experts taken round-robin);
  GB/s of the distinct experts' bytes.
- matrix (--matrix): one expert matrix at 1 thread, one pair, its bytes read from L2 (the fastest of 8 calls a round):
  the kernel's compute bound apart from the memory's. w13 and w2 of each shape.
- dense (--dense OUTxIN): one dense projection (`linear`: every row against one matrix, as attention and LM heads
  are) at each of --rows, the matrix streamed from memory (a copy per call in --span-gb, taken round-robin).

With --interleave b, side B computes int8 pools interleaved (the same codes 16 rows a block, as the CPU's expert
pools hold them: kernels/pool.py), A row-major: give the same revision twice to compare the layouts. With
--interleave ab both sides compute interleaved pools.

    nice -n 19 python bench/kernel_ab.py main WORKTREE --kinds int4,int8 --threads 1,2
    nice -n 19 python bench/kernel_ab.py main WORKTREE --kinds int4,int8 --matrix
    nice -n 19 python bench/kernel_ab.py main WORKTREE --variant avx2   # the AVX2 tiles (no AVX-512)
    nice -n 19 python bench/kernel_ab.py WORKTREE WORKTREE --kinds int8 --interleave b --rows 1,4,16 --threads 2

Prints one JSON line per figure: each side's time and GB/s, B's speed over A's, the largest difference of the two
outputs relative to the largest output (0 where the bits agree). On a shared machine compare the ratios, not the
absolute figures: 2-thread rounds suffer most from the other load (a descheduled thread stalls the product).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import kernel_bench as kb  # noqa: E402

from moelane import kernels  # noqa: E402
from moelane.kernels import hugepages  # noqa: E402
from moelane.kernels.pool import interleaved_pool  # noqa: E402

CSRC = "src/moelane/kernels/csrc"
Call = Callable[[ModuleType, int, str], torch.Tensor]  # (module, call index, side "a" / "b")


class Sides:
    """The pools of each side: as made, or interleaved for the sides in `interleave` (int8 only)."""

    def __init__(self, interleave: str) -> None:
        self.interleave = interleave

    def pools(self, pool: kernels.Pool) -> dict[str, kernels.Pool]:
        if not self.interleave:
            return {"a": pool, "b": pool}
        inter = interleaved_pool(pool)
        if inter is not pool:  # (in huge pages, as the pool)
            inter = kernels.Pool(inter.kind, hugepages.place(inter.data), inter.scales, inter.in_features)
        return {side: inter if side in self.interleave else pool for side in "ab"}


def csrc_files(rev: str) -> dict[str, bytes]:
    """name -> bytes of `rev`'s csrc/ (`WORKTREE`: the files on disk; a folder: its .cpp and .h files)."""
    folder = ROOT / CSRC if rev == "WORKTREE" else Path(rev)
    if folder.is_dir():
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".cpp", ".h")}
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    names = [n for n in listing.stdout.split() if n.endswith((".cpp", ".h"))]
    show = [
        subprocess.run(["git", "show", f"{rev}:{CSRC}/{n}"], cwd=ROOT, capture_output=True, check=True) for n in names
    ]
    return {n: s.stdout for n, s in zip(names, show, strict=True)}


def build(rev: str, variant: str = "native") -> ModuleType:
    """`rev`'s kernels as an extension named by their hash, built under the kernels' cache (once per source and
    variant: `kernels.build.FLAGS`, "avx2" for the tiles an AVX2 machine runs)."""
    from moelane.kernels import build as kbuild

    files = csrc_files(rev)
    key = hashlib.sha256(b"".join(n.encode() + b"\0" + b + b"\0" for n, b in files.items())).hexdigest()[:16]
    key = key if variant == "native" else f"{key}_{variant.replace('-', '_')}"
    folder = kbuild.cache_root() / "ab" / key
    folder.mkdir(parents=True, exist_ok=True)
    src = Path(tempfile.mkdtemp(prefix="kernel_ab_"))
    for name, data in files.items():
        (src / name).write_bytes(data)
    return kbuild._compile(f"moelane_ab_{key}", folder, variant, src)


def layer_call(
    shape: kb.Shape, kind: str, n_rows: int, span_gb: float, g: torch.Generator, sides: Sides
) -> tuple[Call, float]:
    """-> (call(module, i, side): one MoE layer, the distinct experts' bytes per call on average)."""
    one = kb.random_pool(kind, 1, 2 * shape.width, shape.hidden, g).nbytes
    expert_bytes = one + kb.random_pool(kind, 1, shape.hidden, shape.width, g).nbytes
    n_layers = max(1, math.ceil(span_gb * 1e9 / (expert_bytes * shape.n_experts)))
    layers = [
        (
            sides.pools(kb.random_pool(kind, shape.n_experts, 2 * shape.width, shape.hidden, g)),
            sides.pools(kb.random_pool(kind, shape.n_experts, shape.hidden, shape.width, g)),
        )
        for _ in range(n_layers)
    ]
    plan = kb.plan_calls(shape, n_rows, 1000, n_layers, g)
    x = torch.randn(n_rows, shape.hidden, generator=g)
    rows = torch.arange(n_rows).repeat_interleave(shape.top_k)
    pairs = torch.arange(n_rows * shape.top_k)

    def call(module: ModuleType, i: int, side: str) -> torch.Tensor:
        layer, slots, _ = plan[i % len(plan)]
        a, b = layers[layer][0][side], layers[layer][1][side]
        gate_up = module.gather_linear(x, rows, slots, a.data, a.scales)
        h = F.silu(gate_up[:, : shape.width]) * gate_up[:, shape.width :]
        return module.gather_linear(h, pairs, slots, b.data, b.scales)

    return call, statistics.mean(n for _, _, n in plan) * expert_bytes


def matrix_call(kind: str, n_out: int, n_in: int, g: torch.Generator, sides: Sides) -> tuple[Call, float]:
    """-> (call(module, i, side): one slot's [n_out, n_in] product for one row, the slot's bytes)."""
    pools = sides.pools(kb.random_pool(kind, 1, n_out, n_in, g))
    x = torch.randn(1, n_in, generator=g)
    zero = torch.zeros(1, dtype=torch.int64)

    def call(module: ModuleType, i: int, side: str) -> torch.Tensor:
        return module.gather_linear(x, zero, zero, pools[side].data, pools[side].scales)

    return call, pools["a"].nbytes


def dense_call(
    kind: str, n_out: int, n_in: int, n_rows: int, span_gb: float, g: torch.Generator, sides: Sides
) -> tuple[Call, float]:
    """-> (call(module, i, side): a dense product of n_rows rows, the matrix's bytes)."""
    one = kb.random_pool(kind, 1, n_out, n_in, g)
    n_copies = max(0, int(span_gb * 1e9 / one.nbytes))
    copies = [sides.pools(p) for p in [one] + [kb.random_pool(kind, 1, n_out, n_in, g) for _ in range(n_copies)]]
    x = torch.randn(n_rows, n_in, generator=g)

    def call(module: ModuleType, i: int, side: str) -> torch.Tensor:
        pool = copies[i % len(copies) if i else 0][side]
        return module.gather_linear(x, None, None, pool.data, pool.scales)

    return call, one.nbytes


def ab(modules: dict[str, ModuleType], call: Call, rounds: int, calls: int, best: bool) -> dict[str, float]:
    """Seconds per call of each side: the median over rounds of each round's median (or fastest) call."""
    per_round: dict[str, list[float]] = {"a": [], "b": []}
    i = 0
    for r in range(rounds):
        for side in "ab" if r % 2 == 0 else "ba":
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                call(modules[side], i, side)
                times.append(time.perf_counter() - t)
                i += 1
            per_round[side].append(min(times) if best else statistics.median(times))
    return {side: statistics.median(v) for side, v in per_round.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", help="git revision, WORKTREE, or a folder of kernel sources")
    ap.add_argument("b", help="git revision, WORKTREE, or a folder of kernel sources")
    ap.add_argument("--shapes", default=",".join(kb.SHAPES))
    ap.add_argument("--kinds", default="int4,int8")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per round and side")
    ap.add_argument("--span-gb", type=float, default=1.5)
    ap.add_argument("--matrix", action="store_true", help="single matrices from L2 at 1 thread instead of layers")
    ap.add_argument("--dense", metavar="OUTxIN", help="one dense projection of this shape at --rows instead of layers")
    ap.add_argument("--variant", default="native", help="build flags of both sides (kernels.build.FLAGS): native, "
                    "avx2 (the AVX2 tiles, as on a CPU without AVX-512), generic (plain C++, no AVX2), "
                    "no-vnni")  # fmt: skip
    ap.add_argument("--interleave", default="", choices=["", "b", "ab"],
                    help="the sides computing int8 pools interleaved (module docstring)")  # fmt: skip
    args = ap.parse_args()
    sides = Sides(args.interleave)
    modules = {"a": build(args.a, args.variant), "b": build(args.b, args.variant)}
    base = {"bench": "kernel_ab", "git": kb.git_rev(), "a": args.a, "b": args.b, "variant": args.variant,
            "interleave": args.interleave}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    jobs: list[tuple[dict[str, object], Callable[[], tuple[Call, float]]]] = []
    if args.dense:
        n_out, n_in = (int(v) for v in args.dense.split("x"))
        for kind in args.kinds.split(","):
            for n_threads in (int(t) for t in args.threads.split(",")):
                for n_rows in (int(r) for r in args.rows.split(",")):
                    conf = {"what": f"dense {args.dense}", "kind": kind, "rows": n_rows, "threads": n_threads}
                    make = functools.partial(dense_call, kind, n_out, n_in, n_rows, args.span_gb, g, sides)
                    jobs.append((conf, make))
    for name in [] if args.dense else args.shapes.split(","):
        shape = kb.SHAPES[name]
        for kind in args.kinds.split(","):
            if args.matrix:
                for what, (n_out, n_in) in (
                    ("w13", (2 * shape.width, shape.hidden)),
                    ("w2", (shape.hidden, shape.width)),
                ):
                    conf = {"what": what, "shape": name, "kind": kind, "rows": 1, "threads": 1}
                    jobs.append((conf, lambda k=kind, o=n_out, i=n_in: matrix_call(k, o, i, g, sides)))
                continue
            for n_threads in (int(t) for t in args.threads.split(",")):
                for n_rows in (int(r) for r in args.rows.split(",")):
                    conf = {"what": "layer", "shape": name, "kind": kind, "rows": n_rows, "threads": n_threads}
                    jobs.append((conf, lambda s=shape, k=kind, n=n_rows: layer_call(s, k, n, args.span_gb, g, sides)))
    for conf, make in jobs:
        torch.set_num_threads(int(str(conf["threads"])))
        call, nbytes = make()
        ya, yb = call(modules["a"], 0, "a"), call(modules["b"], 0, "b")
        t = ab(modules, call, args.rounds, args.calls, best=args.matrix)
        rec = {
            **base,
            **conf,
            "a_ms": round(t["a"] * 1e3, 4),
            "b_ms": round(t["b"] * 1e3, 4),
            "a_GBps": round(nbytes / t["a"] / 1e9, 2),
            "b_GBps": round(nbytes / t["b"] / 1e9, 2),
            "b_speedup": round(t["a"] / t["b"], 3),
            "max_rel_diff": float((ya - yb).abs().max() / ya.abs().max().clamp(min=1e-30)),
            "load1": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
