"""moelane against llama.cpp under the same kernel-enforced memory ceiling, one process at a time.

Each run is one fresh process, started inside a fresh memory cgroup (tests/cgroup.py: v1 `memory.limit_in_bytes` or
v2 `memory.max`; page cache counts against it) after the page cache is dropped. moelane runs with no
`--expert-memory`, so its budget is the one it derives from the cgroup's limit (`pager.live.ceiling`); llama.cpp
(llama-cpp-python: mmap on, `--threads`, f32 KV cache) maps the GGUF and lets the kernel page it. Both decode the same
token ids greedily, `--tokens` each, never stopping early. Engines alternate within every round (which goes first
alternates too), rounds rotate the prompts (held-out code and prose, in the model's tokenizer).

Ceiling rule (`--overhead each`, the default): an engine's limit = share x the GGUF file's bytes + that engine's own
fixed overhead, each measured first as its peak RSS in an unlimited run of the longest prompt less the weights it
held (all resident: the GGUF's bytes, moelane's in anonymous memory, llama.cpp's as mapped file pages). moelane's
overhead is measured as the row runs it: compiled for the 100% row (where it compiles, unless --eager), paged below
(an expert budget of half the GGUF's bytes; the weights it held are its dense weights and the most expert bytes its
pool held, so the store's bounce buffers and loading threads count as overhead). So at every ceiling each engine
has share x the file for its weights, beyond what it needs to run at all.
`--overhead larger` gives both engines one limit instead, with the largest of the overheads: the engine with the
smaller overhead (llama.cpp) then holds more than the share of its file in page cache.

Per run: decode and prefill tok/s; disk bytes read per decode token (`/proc/self/io` read_bytes from the first token
to the last, over the tokens after the first; the workers read it themselves); the cgroup's peak usage and failcnt;
whether the OOM killer fired. Then a summary table of medians (markdown), moelane over llama.cpp.

    sudo .venv/bin/python bench/ceiling_bench.py --model /work/scratch/inflated-8192 \\
        --gguf /work/scratch/gguf/inflated-8192-bf16.gguf --quant bf16 \\
        --llama-python /work/scratch/llama-noamx-venv/bin/python --rounds 3 --tokens 128

`worker moelane|llama ...` is the per-run process (started by the benchmark; llama's runs under --llama-python, which
needs no torch, so this file imports only the standard library at the top).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from revision import git_rev

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
PROMPTS = {  # held out: not in the shipped model's training corpus
    "code": 'import os\nimport sys\n\n\ndef count_lines(path):\n    """Count the non-empty lines of a file."""\n',
    "prose": "The lighthouse keeper climbed the stairs at dusk, as she had every evening for thirty years, and",
}
SETTINGS = {  # quant -> (moelane dtype, default tier, dense quantisation)
    "bf16": ("bfloat16", "native", "none"),
    "int8": ("float32", "int8", "int8"),
}


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


# ---- workers (one run each, in the cgroup) ------------------------------------------------------------------------


def moelane_worker(args: argparse.Namespace, prompt: list[int]) -> dict[str, object]:
    import torch

    import moelane
    from moelane.pager.live.store import ExpertStore

    dtype, tier, quantize = SETTINGS[args.quant]
    torch.set_num_threads(args.threads)
    lm = moelane.load(args.model, getattr(torch, dtype), default_tier=tier, quantize=quantize,
                      expert_memory=args.expert_memory)  # fmt: skip
    if args.compile and not isinstance(lm.provider, ExpertStore):
        lm.enable_compile()  # as `moelane serve` does where every expert is resident; compiled before the clock starts
        list(lm.generate_ids(prompt[:4], 2, stop_ids=frozenset()))
    io_load, t0 = read_bytes(), time.perf_counter()
    gen = lm.generate_ids(prompt, args.tokens, stop_ids=frozenset())
    tokens = [next(gen)]
    t_first, io_first = time.perf_counter(), read_bytes()
    tokens.extend(gen)
    t_end, io_end = time.perf_counter(), read_bytes()
    out: dict[str, object] = {"memory": lm.memory.lines()[0] if lm.memory else None}
    if isinstance(lm.provider, ExpertStore):
        s = lm.provider.stats.to_dict()
        out["pager"] = {"hit_rate": round(s["by_phase"].get("decode", {}).get("hit_rate", 0.0), 3),
                        "stall_s": round(s["by_phase"].get("decode", {}).get("stall_s", 0.0), 2),
                        "budget_mib": lm.provider.config.budget_bytes // MiB, "prefetch": s["prefetch"]}  # fmt: skip
        out["weights_bytes"] = resident_dense_bytes(lm.model) + lm.provider.high_water_bytes
    lm.close()
    return {**out, **timings(len(prompt), tokens, t0, t_first, t_end, io_load, io_first, io_end)}


def resident_dense_bytes(model: object) -> int:
    """Bytes of the model's own weights in memory, each storage once: its parameters and buffers (embeddings too,
    which `footprint.dense_bytes`, the bytes a pass reads, leaves out), and the projections the kernels hold as pools
    (`weights.prepare_weights`: plain attributes, no longer parameters). With a store that is every weight but the
    experts, which live in its pool."""
    import torch

    from moelane import kernels

    assert isinstance(model, torch.nn.Module)
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(pool := getattr(module, "weight", None), kernels.Pool):
            tensors += [pool.data] if pool.scales is None else [pool.data, pool.scales]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def llama_worker(args: argparse.Namespace, prompt: list[int]) -> dict[str, object]:
    import llama_cpp

    llm = llama_cpp.Llama(args.gguf, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, type_k=0,
                          type_v=0, use_mmap=True, verbose=False)  # fmt: skip
    io_load, t0 = read_bytes(), time.perf_counter()
    llm.eval(prompt)
    tokens = [llm.sample(temp=0.0)]
    t_first, io_first = time.perf_counter(), read_bytes()
    for _ in range(args.tokens - 1):
        llm.eval([tokens[-1]])
        tokens.append(llm.sample(temp=0.0))
    t_end, io_end = time.perf_counter(), read_bytes()
    return timings(len(prompt), tokens, t0, t_first, t_end, io_load, io_first, io_end)


def timings(n_prompt: int, tokens: list[int], t0: float, t_first: float, t_end: float, io_load: int, io_first: int,
            io_end: int) -> dict[str, object]:  # fmt: skip
    n_after = max(1, len(tokens) - 1)
    return {"prefill_tok_s": n_prompt / (t_first - t0), "decode_tok_s": (len(tokens) - 1) / (t_end - t_first),
            "disk_per_token": (io_end - io_first) / n_after, "disk_load": io_load, "disk_prefill": io_first - io_load,
            "tokens": tokens, "max_rss": peak_rss()}  # fmt: skip


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=("moelane", "llama"))
    p.add_argument("--model")
    p.add_argument("--gguf")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--expert-memory", help="moelane's expert budget (default: from the limit it runs under)")
    args = p.parse_args(argv)
    if args.engine == "moelane":
        sys.path.insert(0, str(ROOT / "src"))
    prompt = [int(t) for t in args.prompt.split(",")]
    run = moelane_worker if args.engine == "moelane" else llama_worker
    print(json.dumps(run(args, prompt)), flush=True)


# ---- the benchmark ------------------------------------------------------------------------------------------------


def run_one(args: argparse.Namespace, engine: str, prompt: list[int], limit: int, expert_memory: str | None = None
            ) -> dict[str, object]:  # fmt: skip
    """One engine, one prompt, in a fresh cgroup of `limit` bytes after the page cache is dropped (`expert_memory`:
    moelane's budget given as the flag, else the one it derives from the limit)."""
    from tests.cgroup import MemoryGroup, drop_page_cache

    python = sys.executable if engine == "moelane" else args.llama_python
    argv = [python, __file__, "worker", engine, "--model", str(args.model), "--gguf", str(args.gguf), "--quant",
            args.quant, "--prompt", ",".join(map(str, prompt)), "--tokens", str(args.tokens), "--threads",
            str(args.threads), *(["--compile"] if args.compile else []),
            *(["--expert-memory", expert_memory] if expert_memory else [])]  # fmt: skip
    drop_page_cache()
    group = MemoryGroup.create(limit, "moelane-bench")
    if group is None:
        raise SystemExit("no memory cgroup can be made here (run as root on a machine with the memory controller)")
    t0 = time.perf_counter()
    proc = group.spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    usage = group.usage()
    group.remove()
    killed = usage.oom_kills > 0 or proc.returncode == -signal.SIGKILL
    record: dict[str, object] = {"engine": engine, "limit": limit, "rc": proc.returncode, "peak": usage.peak,
                                 "wall_s": round(time.perf_counter() - t0, 1), "failcnt": usage.failcnt,
                                 "oom_kill": killed}  # fmt: skip
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        record.update(json.loads(lines[-1]))
    else:
        record["error"] = err.strip().splitlines()[-1:] if err.strip() else f"exit {proc.returncode}"
    return record


def overheads(args: argparse.Namespace, prompt: list[int], gguf_bytes: int) -> dict[str, int]:
    """Each engine's fixed overhead: its peak RSS in an unlimited run of `prompt` less the weights it held. All
    resident, that is the GGUF's bytes: llama.cpp's, moelane's compiled ("moelane compiled", unless --eager) and
    eager ("moelane"). Paged ("moelane paged", at an expert budget of half the GGUF's bytes), the dense weights and the
    most expert bytes the pool held: the bounce buffers and loading threads a store adds are overhead too."""
    found = {}
    runs = [("moelane", False, None), ("llama", False, None), ("moelane", False, str(gguf_bytes // 2))]
    runs += [("moelane", True, None)] if args.compile else []
    for engine, compiled, budget in runs:
        record = run_one(argparse.Namespace(**{**vars(args), "compile": compiled}), engine, prompt, 64 << 30, budget)
        if "max_rss" not in record:
            raise SystemExit(f"{engine} failed unlimited: {record}")
        name = f"{engine} compiled" if compiled else f"{engine} paged" if budget else engine
        weights = int(record.get("weights_bytes", gguf_bytes))  # type: ignore[call-overload]
        found[name] = int(record["max_rss"]) - weights  # type: ignore[call-overload]
        print(json.dumps({"event": "overhead", "engine": name, "max_rss": record["max_rss"], "weights": weights,
                          "overhead": found[name]}), flush=True)  # fmt: skip
    return found


def limit_for(args: argparse.Namespace, found: dict[str, int], engine: str, share: float, gguf_bytes: int) -> int:
    """The ceiling of `engine` at `share` of the GGUF (module docstring: the ceiling rule)."""
    if args.overhead == "larger":
        return int(share * gguf_bytes) + max(found.values())
    if engine == "moelane" and share < 1.0:
        return int(share * gguf_bytes) + found["moelane paged"]
    compiled = engine == "moelane" and args.compile
    return int(share * gguf_bytes) + found[f"{engine} compiled" if compiled else engine]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="the model folder moelane runs (safetensors)")
    p.add_argument("--gguf", type=Path, required=True, help="the same model as llama.cpp runs it")
    p.add_argument("--quant", choices=tuple(SETTINGS), default="bf16", help="bf16 (against BF16) or int8 (Q8_0)")
    p.add_argument("--llama-python", default=sys.executable, help="a Python whose llama-cpp-python runs llama.cpp")
    p.add_argument("--shares", default="1.0,0.5,0.35,0.25", help="ceilings as shares of the GGUF's bytes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--eager",
        dest="compile",
        action="store_false",
        help="never compile moelane's decode step (by "
        "default it is compiled where every expert is resident, as `moelane serve` does)",
    )
    p.add_argument("--overhead", choices=("each", "larger"), default="each",
                   help="each: every engine's limit is the share plus its own overhead; larger: one limit for both, "
                   "with the larger overhead (default each)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=900, help="seconds before a run is killed")
    p.add_argument("--out", type=Path, help="also append every JSON line to this file")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompts = {name: tokenizer.encode(text).ids for name, text in PROMPTS.items()}
    gguf_bytes = args.gguf.stat().st_size
    found = overheads(args, max(prompts.values(), key=len), gguf_bytes)
    shares = [float(s) for s in args.shares.split(",")]
    records = []
    for r in range(args.rounds):
        name = list(prompts)[r % len(prompts)]
        for share in shares:
            order = ("moelane", "llama") if r % 2 == 0 else ("llama", "moelane")
            for engine in order:
                record = run_one(args, engine, prompts[name], limit_for(args, found, engine, share, gguf_bytes))
                record.update(round=r, share=share, prompt=name, quant=args.quant, git=git_rev(ROOT))
                records.append(record)
                emit(args, {k: v for k, v in record.items() if k != "tokens"})
    emit(args, {"summary": True, "quant": args.quant, "overheads": found, "rule": args.overhead,
                "gguf_bytes": gguf_bytes, "tokens": args.tokens, "rounds": args.rounds,
                "git": git_rev(ROOT)})  # fmt: skip
    print(table(records, shares, args.quant))


def emit(args: argparse.Namespace, record: dict[str, object]) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(line + "\n")


def median(records: list[dict[str, object]], key: str) -> float | None:
    values = [float(r[key]) for r in records if key in r]  # type: ignore[arg-type]
    return statistics.median(values) if values else None


def table(records: list[dict[str, object]], shares: list[float], quant: str) -> str:
    """Medians per ceiling: decode and prefill tok/s, disk MB per decode token, peak, failcnt, OOM kills, and
    moelane's ratios to llama.cpp (decode speed; disk bytes per token)."""
    ref = {"bf16": "BF16", "int8": "Q8_0"}[quant]
    head = ("| ceiling | engine | decode tok/s | prefill tok/s | disk MB/token | peak MiB | failcnt | OOM kills "
            "| runs |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    rows, ratios = [head], []
    for share in shares:
        at = [r for r in records if r["share"] == share]
        medians = {}
        for engine, label in (("moelane", f"moelane {quant}"), ("llama", f"llama.cpp {ref}")):
            runs = [r for r in at if r["engine"] == engine]
            m = {k: median(runs, k) for k in ("decode_tok_s", "prefill_tok_s", "disk_per_token", "peak", "failcnt")}
            medians[engine] = m
            oom = sum(1 for r in runs if r["oom_kill"])
            limit = int(runs[0]["limit"]) // MiB if runs else 0  # type: ignore[call-overload]
            rows.append(f"| {share:.0%} ({limit:,} MiB) | {label} | {fmt(m['decode_tok_s'], 2)} | "
                        f"{fmt(m['prefill_tok_s'], 1)} | {fmt(m['disk_per_token'], 1, 1e6)} | {fmt(m['peak'], 0, MiB)} "
                        f"| {fmt(m['failcnt'], 0)} | {oom} | {len(runs)} |")  # fmt: skip
        ours, theirs = medians["moelane"], medians["llama"]
        speed = ratio(ours["decode_tok_s"], theirs["decode_tok_s"])
        # all resident, neither engine reads experts from disk: a ratio of stray reads would mean nothing
        disk = "-" if share >= 1.0 else ratio(ours["disk_per_token"], theirs["disk_per_token"])
        ratios.append(f"| {share:.0%} | {speed} | {disk} |")
    return "\n".join([*rows, "", "| ceiling | decode, moelane / llama.cpp | disk per token, moelane / llama.cpp |",
                      "|---|---|---|", *ratios])  # fmt: skip


def fmt(value: float | None, digits: int, unit: float = 1.0) -> str:
    return "-" if value is None else f"{value / unit:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{a / b:.2f}x" if b > 0 else ("1.00x" if a == 0 else "inf")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        main()
