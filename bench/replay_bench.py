"""Replay speed: the planner over a synthetic 100k-token, 48-layer, 128-expert, top-8 trace (target: <= 60 s, one core).

Prints JSON lines (config, git revision, wall and CPU seconds, load average, hit rates); also the trace's size on
disk. On a shared machine CPU seconds of this one-threaded process are the figure to compare with the target. Run:
    OMP_NUM_THREADS=1 .venv/bin/python bench/replay_bench.py [--tokens 100000] [--policies planner lru]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from moelane.pager.lab.policies import make_policy
from moelane.pager.lab.replay import replay
from moelane.pager.lab.synth import SynthConfig, synth_trace
from moelane.pager.trace import read_trace, write_trace
from revision import git_rev


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--policies", nargs="+", default=["planner"])
    a = ap.parse_args()
    n_requests = max(1, a.tokens // 2048)
    per = a.tokens // n_requests
    cfg = SynthConfig(
        n_layers=a.layers, n_experts=a.experts, top_k=a.top_k, n_requests=n_requests,
        prefill_tokens=per // 2, prefill_chunk=256, decode_tokens=per - per // 2, expert_bytes=8 << 20,
    )  # fmt: skip
    base = {"git": git_rev(), "tokens": n_requests * per, "layers": a.layers, "experts": a.experts,
            "top_k": a.top_k, "requests": n_requests, "threads": os.environ.get("OMP_NUM_THREADS")}  # fmt: skip
    t0 = time.perf_counter()
    trace = synth_trace(cfg)
    gen_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.trc")
        t0 = time.perf_counter()
        write_trace(path, trace)
        write_s = time.perf_counter() - t0
        size = os.path.getsize(path)
        t0 = time.perf_counter()
        trace = read_trace(path)
        read_s = time.perf_counter() - t0
    print(json.dumps({**base, "what": "trace", "synth_s": gen_s, "write_s": write_s, "read_s": read_s,
                      "file_mb": size / 1e6}), flush=True)  # fmt: skip
    slots = round(a.fraction * trace.header.n_total)
    for spec in a.policies:
        t0, c0 = time.perf_counter(), time.process_time()
        r = replay(trace, make_policy(spec), slots)
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        d = r.to_dict()
        row = {"what": "replay", "policy": spec, "slots": slots, "fraction": a.fraction, "seconds": secs, "cpu_s": cpu,
               "loadavg_1m": os.getloadavg()[0], "decode_hit_rate": d["decode_hit_rate"],
               "prefill_hit_rate": d["prefill"]["hit_rate"]}  # fmt: skip
        print(json.dumps({**base, **row}), flush=True)


if __name__ == "__main__":
    main()
