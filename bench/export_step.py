"""A trial, not a path moelane runs: the resident decode step exported once (`torch.export`, non-strict) and compiled
by AOTInductor, against the same step through `torch.compile` (Dynamo, then Inductor's Python wrapper), on one
model, one pool, in one process.

    python bench/export_step.py --model DIR [--quant int4] [--calls 300] [--rounds 3]

Prints one JSON line per round (each side's median call in us, alternated) and a summary: the medians, whether the
exported step's logits are the compiled step's bits, and whether it wrote the KV cache in place. The export takes
the row count, the reach and the pool's slots and capacity as dims. docs/kernels.md "Against llama.cpp" has what it
measured and what stands between it and the engine: the package holds its own copy of every weight (AOTInductor's
default), each pool count needs its export, and the step's inputs must be plain tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import moelane
from moelane.model.lm import LM

sys.path.insert(0, str(Path(__file__).parent))
import decode_bench  # (bench/: its precision settings)


class Step(torch.nn.Module):
    """`LM._decode_step` over one pool whose per-layer K/V tensors come in as arguments (export needs tensors)."""

    def __init__(self, lm: Any, pool: Any) -> None:
        super().__init__()
        self.lm, self.pool, self.model = lm, pool, lm.model
        self.layers = sorted(pool.k)

    def forward(self, rows: torch.Tensor, keys: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> Any:
        kept = dict(self.pool.k), dict(self.pool.v)
        try:
            for layer, k, v in zip(self.layers, ks, vs, strict=True):
                self.pool.k[layer], self.pool.v[layer] = k, v
            return LM._decode_step(self.lm, [(rows, self.pool, keys)])
        finally:
            self.pool.k, self.pool.v = kept


def median_us(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model folder (bench/decode_bench.py builds the 115M one)")
    ap.add_argument("--quant", default="int4", choices=sorted(decode_bench.SETTINGS))
    ap.add_argument("--calls", type=int, default=300, help="timed calls per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = decode_bench.SETTINGS[args.quant]
    lm = moelane.load(Path(args.model), s.dtype, compile=True, default_tier=s.default_tier, quantize=s.quantize)
    torch.set_grad_enabled(False)
    cache = lm.cache_for(16, 200)
    lm.forward([moelane.model.cache.Rows(cache, list(range(10, 26)), 0)])
    pool = cache.pool
    ks, vs = [pool.k[layer] for layer in sorted(pool.k)], [pool.v[layer] for layer in sorted(pool.v)]
    keys = torch.arange(256)
    n, reach = torch.export.Dim("rows", min=1, max=16), torch.export.Dim("reach", min=2, max=lm.max_context)
    slots, capacity = torch.export.Dim("slots", min=1, max=4095), torch.export.Dim("capacity", min=2, max=4096)
    kv_dims = [{0: slots, 2: capacity}] * len(ks)
    dims = {"rows": {0: n}, "keys": {0: reach}, "ks": kv_dims, "vs": kv_dims}
    example = torch.tensor([[11, 16, cache.slot], [12, 17, cache.slot]])
    t = time.perf_counter()
    program = torch.export.export(Step(lm, pool), (example, keys, ks, vs), dynamic_shapes=dims, strict=False)
    exported_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        package = torch._inductor.aoti_compile_and_package(program, package_path=f"{folder}/step.pt2")
        compiled_s = time.perf_counter() - t
        package_mb = Path(package).stat().st_size / 1e6
        runner = torch._inductor.aoti_load_package(package)

    pool.mark_dynamic()
    row = torch.tensor([[13, 16, cache.slot]])
    torch._dynamo.decorators.mark_unbacked(row, 0)
    torch._dynamo.decorators.mark_unbacked(keys, 0)
    assert lm._compiled is not None
    dynamo = lm._compiled([(row, pool, keys)]).clone()
    exported = runner(row, keys, ks, vs).clone()
    before = pool.k[0][cache.slot, :, 40].clone()
    runner(torch.tensor([[14, 40, cache.slot]]), keys, ks, vs)
    in_place = not torch.equal(before, pool.k[0][cache.slot, :, 40])

    a, b = [], []
    for r in range(args.rounds):
        a.append(median_us(lambda: lm._compiled([(row, pool, keys)]), args.calls))  # type: ignore[misc]
        b.append(median_us(lambda: runner(row, keys, ks, vs), args.calls))
        print(json.dumps({"round": r, "dynamo_us": round(a[-1]), "exported_us": round(b[-1])}), flush=True)
    print(json.dumps({
        "summary": True, "git": decode_bench.git_rev(), "model": args.model, "quant": args.quant,
        "threads": args.threads,
        "dynamo_us": round(statistics.median(a)), "exported_us": round(statistics.median(b)),
        "speedup": round(statistics.median(a) / statistics.median(b), 3), "same_bits": torch.equal(dynamo, exported),
        "kv_written_in_place": in_place, "export_s": round(exported_s, 1), "aoti_compile_s": round(compiled_s, 1),
        "package_MB": round(package_mb, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
