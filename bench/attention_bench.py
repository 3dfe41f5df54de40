"""Eager attention of one decode round, two git revisions side by side in one process: `attend_streams` of
revision A and of revision B on the same caches and queries, alternated (ABBA...), medians; and whether their
outputs are the same bits.

Shapes are those of the shipped model and of the models users bring (query heads, KV heads, head dim): a round of
N streams, one decode row each, at a given position (the attention reach follows it). Eager attention is what runs
whenever the experts are paged (a compiled step needs them all resident) and for every prompt chunk.

    python bench/attention_bench.py c645f6e HEAD
    python bench/attention_bench.py main HEAD --streams 1,8,16 --position 2000 --threads 2
    python bench/attention_bench.py main HEAD --streams 8,16 --position 300 --capacity 512 --pools 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {  # name: (query heads, KV heads, head dim)
    "shipped": (6, 2, 32),
    "qwen3-30b-a3b": (32, 4, 128),
    "mixtral-8x7b": (32, 8, 128),
    "olmoe": (16, 16, 128),
}


def attention_of(rev: str, into: Path) -> ModuleType:
    """`rev`'s `moelane/model/attention.py`, imported under a name of its own; before attention had a module of its
    own, `rev`'s `layers.py`, which held it. (What the module imports, its building blocks in `layers.py` and the
    caches, comes from this checkout.)"""
    for stem in ("attention", "layers"):
        shown = subprocess.run(["git", "show", f"{rev}:src/moelane/model/{stem}.py"], cwd=ROOT,
                               capture_output=True, text=True)  # fmt: skip
        if shown.returncode == 0:
            break
    shown.check_returncode()
    path = into / f"{stem}_{rev.replace('/', '_')}.py"
    path.write_text(shown.stdout)
    name = f"{stem}_{len(sys.modules)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revs", nargs=2, help="git revisions A (base) and B (change)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--streams", default="1,8")
    ap.add_argument("--position", type=int, default=1000, help="the streams' position (their reach follows)")
    ap.add_argument("--capacity", type=int, default=2048, help="the caches' capacity")
    ap.add_argument("--pools", type=int, default=1,
                    help="spread the streams over this many pools, of capacities --capacity, +256, +512, ... "
                         "(stream i in pool i mod N: streams of varied prompt and reply lengths)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds; medians reported")
    ap.add_argument("--calls", type=int, default=30, help="calls per round")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from moelane.model.cache import KVCache, KVPool

    with tempfile.TemporaryDirectory() as tmp:
        builds = {"A": attention_of(args.revs[0], Path(tmp)), "B": attention_of(args.revs[1], Path(tmp))}
        for shape in args.shapes.split(","):
            n_heads, n_kv, d = SHAPES[shape]
            for n in (int(x) for x in args.streams.split(",")):
                torch.manual_seed(0)
                pools = [KVPool({0: (n_kv, d, d)}, args.capacity + 256 * j, torch.float32) for j in range(args.pools)]
                caches = [KVCache(pools[i % args.pools]) for i in range(n)]
                for c in caches:
                    c.pool.prepare(c.slot, c.capacity)
                    c.pool.k[0][c.slot].normal_()
                    c.pool.v[0][c.slot].normal_()
                positions = torch.tensor([args.position + i for i in range(n)])
                q, k, v = torch.randn(n, n_heads, d), torch.randn(n, n_kv, d), torch.randn(n, n_kv, d)

                ends = tuple(int(p) + 1 for p in positions)
                calls = {b: partial(attend, m, (q, k, v), batch_of(m, caches, positions, ends), d**-0.5)
                         for b, m in builds.items()}  # fmt: skip
                same = torch.equal(calls["A"](), calls["B"]())
                us: dict[str, list[float]] = {"A": [], "B": []}
                for r in range(args.rounds):
                    for build in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            calls[build]()
                        us[build].append((time.perf_counter() - t0) / args.calls * 1e6)
                median = {b: round(statistics.median(t), 1) for b, t in us.items()}
                print(json.dumps({"shape": shape, "heads": [n_heads, n_kv, d], "streams": n, "pools": args.pools,
                                  "position": args.position, "us_per_layer": median,
                                  "A_over_B": round(median["A"] / median["B"], 2), "same_bits": same,
                                  "threads": args.threads, "revs": args.revs}), flush=True)  # fmt: skip


def batch_of(attention: ModuleType, caches: list, positions: torch.Tensor, ends: tuple[int, ...]) -> object:
    """A decode round's batch (one row per stream) in `attention`'s own `Batch`."""
    return attention.Batch(tuple((i, 1) for i in range(len(caches))), tuple(caches), positions, ends)


def attend(attention: ModuleType, qkv: tuple[torch.Tensor, ...], batch: object, scale: float) -> torch.Tensor:
    return attention.attend_streams(*qkv, 0, batch, scale)


if __name__ == "__main__":
    main()
