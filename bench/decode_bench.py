"""Decode speed at batch 1: moelane (eager and compiled) against transformers and llama.cpp on the same model.

Builds a random qwen3_moe into --model unless it holds a model (`--shape`: by default ~115M params, vocab 32000,
hidden 512, 8 layers, 32 experts, top-4; `qwen3-30b-a3b`: Qwen3-30B-A3B's layer shapes for 4 of its layers), then
alternates the engines round by round and prints one JSON line per measurement and a summary line with medians and
ratios. llama.cpp runs only when `llama_cpp` is importable and a converter is found (--llama-cpp DIR, the llama.cpp
tree in llama-cpp-python's sdist); it uses an f32 KV cache.

    python bench/decode_bench.py --rounds 3 --tokens 128
    python bench/decode_bench.py --model /tmp/q3shape --shape qwen3-30b-a3b --quant bf16,int8,int4 \\
        --engines moelane-compiled,llama.cpp --llama-cpp TREE --llama-python PY --rounds 5 --tokens 64
    python bench/decode_bench.py --model /tmp/inflated --quant bf16,int8,int4,experts-int4 --tokens 64 \\
        --gguf-dir /tmp/gguf --llama-python /path/to/venv/bin/python

`--quant` runs each precision in both engines (bf16 against llama.cpp's BF16, int8 and int4 of all weights against
Q8_0 and Q4_0; experts-int4 has no llama.cpp match); llama.cpp runs in a worker process (bench/llama_worker.py) under
`--llama-python`, so a build of one's choice can be compared. Each summary says how many greedy tokens agree.

`--moelane-gguf` also runs moelane on llama.cpp's GGUF file itself (engine `gguf`, compiled where moelane-compiled
runs), as `moelane run --model x.gguf` loads it: Q8_0 / Q4_0 experts and dense projections held as the file's own
codes (int8 / int4), other block-quantised projections at their nearest tier, other dense tensors decoded to
float32. `--expert-memory` gives every moelane engine that expert budget; a summary line per paged engine then says
its hit rate.

    python bench/decode_bench.py --model inflated-8192 --quant int8,int4 --engines llama.cpp --moelane-gguf \
        --gguf-dir gguf --llama-python PY --rounds 3 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.helpers import save_model

import llama_gguf
from revision import git_rev

PROMPT_TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    "  # (code: the shipped and inflated models know it)
PROMPT: list[int] = []  # its ids in the model's tokenizer (`main`)


# Random qwen3_moe models a run builds where --model has no config.json (vocab 32000), and the dtype they are built
# and saved in:
# - 115m: ~115M params, small enough that per-op costs decide (float32);
# - qwen3-30b-a3b: Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of
#   768, top-8) for 4 of its 48 layers, 2.6B params (5.2 GB in bf16): a decode step reads ~580 MB in bf16, bound by
#   memory.
SHAPES: dict[str, dict[str, Any]] = {
    "115m": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=192, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                 max_position_embeddings=2048, dtype=torch.float32),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, max_position_embeddings=4096, dtype=torch.bfloat16),
}  # fmt: skip


def build_model(folder: Path, shape: str = "115m") -> Path:
    if (folder / "config.json").exists():
        return folder
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    params = dict(SHAPES[shape])
    dtype = params.pop("dtype")
    config = Qwen3MoeConfig(vocab_size=32000, norm_topk_prob=True, tie_word_embeddings=False, **params)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"event": "built", "shape": shape, "params": n, "folder": str(folder)}), flush=True)
    save_model(model, folder, 32000)
    return folder


@dataclass(frozen=True)
class Setting:
    """One precision as both engines run it: moelane's load settings, and llama.cpp's GGUF type (None: no match)."""

    dtype: torch.dtype
    default_tier: str
    quantize: str
    gguf: str | None


# int8 / int4 compute in float32 between the products (activations, KV cache), as llama.cpp does with an f32 KV cache.
SETTINGS = {
    "float32": Setting(torch.float32, "native", "none", "f32"),
    "bf16": Setting(torch.bfloat16, "native", "none", "bf16"),
    "int8": Setting(torch.float32, "int8", "int8", "q8_0"),
    "int4": Setting(torch.float32, "int4", "int4", "q4_0"),
    "experts-int4": Setting(torch.bfloat16, "int4", "none", None),
}


def moelane_runner(
    folder: Path,
    setting: Setting,
    compiled: bool,
    tokens: int,
    expert_memory: str | None = None,
    device: str = "cpu",
    host_memory: str | None = None,
    cuda_graphs: bool = False,
) -> Callable[[], float]:
    import moelane

    lm = moelane.load(folder, setting.dtype, compile=compiled, default_tier=setting.default_tier,
                      quantize=setting.quantize, expert_memory=expert_memory, host_memory=host_memory,
                      device=device)  # fmt: skip
    if cuda_graphs:
        lm.enable_compile(cuda_graphs=True)
    last: list[list[int]] = []

    def run() -> float:
        gen = lm.generate_ids(PROMPT, tokens, stop_ids=frozenset())
        ids = [next(gen)]  # prefill + first token
        t0 = time.perf_counter()
        ids.extend(gen)
        tps = (len(ids) - 1) / (time.perf_counter() - t0)
        last[:] = [ids]
        return tps

    run()  # warm-up (compiles when compiled)
    run.tokens = last  # type: ignore[attr-defined]
    run.lm = lm  # type: ignore[attr-defined]
    return run


def transformers_runner(folder: Path, dtype: torch.dtype, tokens: int, device: str = "cpu") -> Callable[[], float]:
    from transformers import AutoModelForCausalLM

    from moelane.device import synchronize

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype).eval().to(device)
    ids = torch.tensor([PROMPT], device=device)

    def run() -> float:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(tokens - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            synchronize(token.device)
        return (tokens - 1) / (time.perf_counter() - t0)

    run()
    return run


def gguf_file(folder: Path, kind: str, gguf_dir: Path | None, llama_tree: str | None, python: str) -> Path | None:
    """The model as a llama.cpp GGUF of `kind`: found in `gguf_dir` (`*-{kind}.gguf`), or converted (and quantised
    from the bf16 conversion) into the model folder with llama.cpp's own tools."""
    if gguf_dir is not None and (found := sorted(gguf_dir.glob(f"*-{kind}.gguf"))):
        return found[0]
    made = folder / f"model-{kind}.gguf"
    if made.exists():
        return made
    if not llama_tree:
        return None
    if kind in llama_gguf.FTYPES:
        bf16 = llama_gguf.convert(folder, folder / "model-bf16.gguf", Path(llama_tree), "bf16")
        return llama_gguf.quantize(bf16, made, kind, python)
    return llama_gguf.convert(folder, made, Path(llama_tree), kind)


def llama_runner(gguf_path: Path, python: str, tokens: int) -> Callable[[], float]:
    """A worker process (bench/llama_worker.py) under `python`, one round a call."""
    worker = subprocess.Popen(
        [python, str(Path(__file__).parent / "llama_worker.py"), str(gguf_path), "--threads",
         str(torch.get_num_threads()), "--tokens", str(tokens), "--prompt", ",".join(map(str, PROMPT))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert worker.stdin is not None and worker.stdout is not None
    if not json.loads(worker.stdout.readline()).get("ready"):
        raise SystemExit(f"llama.cpp could not load {gguf_path}")
    last: list[list[int]] = []

    def run() -> float:
        assert worker.stdin is not None and worker.stdout is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
        line = worker.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp worker on {gguf_path} died")
        answer = json.loads(line)
        last[:] = [answer["tokens"]]
        return float(answer["decode_tok_s"])

    run()
    run.tokens = last  # type: ignore[attr-defined]
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/moelane-bench-qwen3moe-115m"))
    p.add_argument("--shape", default="115m", choices=SHAPES,
                   help="the random model built into --model where it has no config.json")  # fmt: skip
    p.add_argument("--quant", default="float32",
                   help=f"precisions, comma-separated, each run by both engines where they match: {', '.join(SETTINGS)}"
                   " (bf16 against llama.cpp BF16, int8 and int4 (all weights) against Q8_0 and Q4_0)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--llama-cpp", help="llama.cpp tree with convert_hf_to_gguf.py (vendor/llama.cpp in its sdist)")
    p.add_argument("--gguf-dir", type=Path, help="GGUFs of the model made already, named *-{f32,bf16,q8_0,q4_0}.gguf")
    p.add_argument("--llama-python", default=sys.executable,
                   help="the Python whose llama-cpp-python runs llama.cpp (default this one)")  # fmt: skip
    p.add_argument("--engines", default="moelane,moelane-compiled,transformers,llama.cpp")
    p.add_argument("--moelane-gguf", action="store_true",
                   help="also run moelane on the GGUF file llama.cpp runs (its default tier: Q8_0 / Q4_0 experts as "
                   "their codes)")  # fmt: skip
    p.add_argument("--expert-memory", help="moelane's expert budget (512MiB, 25%%; default: all resident)")
    p.add_argument("--host-memory", help="moelane's host-RAM expert cache (pinned on a GPU; default none)")
    p.add_argument("--device", default="cpu",
                   help="where moelane and transformers compute: cpu, cuda, cuda:N (default cpu)")  # fmt: skip
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also run moelane compiled with CUDA graphs (engine moelane-graphs; its tokens are compared "
                   "with moelane-compiled's)")  # fmt: skip
    args = p.parse_args()
    folder = build_model(args.model, args.shape)
    from tokenizers import Tokenizer

    PROMPT[:] = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT_TEXT).ids
    wanted = args.engines.split(",")
    runners: dict[tuple[str, str], Callable[[], float]] = {}
    for quant in args.quant.split(","):
        if quant not in SETTINGS:
            raise SystemExit(f"unknown --quant {quant!r}: use {', '.join(SETTINGS)}")
        setting = SETTINGS[quant]
        if "moelane" in wanted:
            runners[(quant, "moelane")] = moelane_runner(folder, setting, False, args.tokens, args.expert_memory,
                                                         args.device, args.host_memory)  # fmt: skip
        if "moelane-compiled" in wanted:
            t0 = time.perf_counter()
            runners[(quant, "moelane-compiled")] = moelane_runner(folder, setting, True, args.tokens,
                                                                  args.expert_memory, args.device,
                                                                  args.host_memory)  # fmt: skip
            print(json.dumps({"event": "compiled", "quant": quant, "seconds": round(time.perf_counter() - t0, 1)}),
                  flush=True)  # fmt: skip
        if args.cuda_graphs:
            graphs = moelane_runner(folder, setting, True, args.tokens, args.expert_memory, args.device,
                                    args.host_memory, cuda_graphs=True)  # fmt: skip
            runners[(quant, "moelane-graphs")] = graphs
        if args.moelane_gguf and setting.gguf is not None:
            path = gguf_file(folder, setting.gguf, args.gguf_dir, args.llama_cpp, args.llama_python)
            if path is None:
                raise SystemExit(f"--moelane-gguf: no {setting.gguf} GGUF of the model (--gguf-dir, --llama-cpp)")
            as_read = Setting(torch.float32, "auto", "auto", setting.gguf)
            compiled = "moelane-compiled" in wanted or "moelane" not in wanted
            runners[(quant, "gguf")] = moelane_runner(path, as_read, compiled, args.tokens, args.expert_memory,
                                                      args.device, args.host_memory)  # fmt: skip
        if "transformers" in wanted and setting.quantize == "none" and setting.default_tier == "native":
            runners[(quant, "transformers")] = transformers_runner(folder, setting.dtype, args.tokens, args.device)
        if "llama.cpp" in wanted and setting.gguf is not None:
            path = gguf_file(folder, setting.gguf, args.gguf_dir, args.llama_cpp, args.llama_python)
            if path is not None:
                runners[(quant, "llama.cpp")] = llama_runner(path, args.llama_python, args.tokens)
    results: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for r in range(args.rounds):
        for (quant, name), run in runners.items():
            tps = run()
            results[(quant, name)].append(tps)
            print(json.dumps({"round": r, "quant": quant, "engine": name, "decode_tok_s": round(tps, 1)}), flush=True)
    print_summary(args, results, runners)


def print_summary(
    args: argparse.Namespace,
    results: dict[tuple[str, str], list[float]],
    runners: dict[tuple[str, str], Callable[[], float]],
) -> None:
    """A JSON summary line per precision (medians, moelane's best against each reference, whether its greedy tokens
    equal llama.cpp's), then a table."""
    rows = []
    for quant in args.quant.split(","):
        medians = {name: statistics.median(v) for (q, name), v in results.items() if q == quant}
        summary: dict[str, object] = {
            "summary": True, "git": git_rev(), "quant": quant, "threads": torch.get_num_threads(),
            "device": args.device, "tokens": args.tokens, "rounds": args.rounds,
            "median_tok_s": {k: round(v, 1) for k, v in medians.items()},
        }  # fmt: skip
        best = max((v for k, v in medians.items() if k.startswith("moelane") or k == "gguf"), default=None)
        for ref in ("transformers", "llama.cpp"):
            if best is not None and ref in medians:
                summary[f"moelane_vs_{ref}"] = round(best / medians[ref], 2)
        if (quant, "moelane-graphs") in runners and (quant, "moelane-compiled") in runners:
            a, b = (runners[(quant, k)].tokens[0] for k in ("moelane-graphs", "moelane-compiled"))  # type: ignore[attr-defined]
            summary["graphs_same_tokens_as_compiled"] = a == b
        ours = [runners[(quant, k)] for k in ("gguf", "moelane-compiled", "moelane") if (quant, k) in runners]
        if ours and (quant, "llama.cpp") in runners:
            a, b = ours[0].tokens[0], runners[(quant, "llama.cpp")].tokens[0]  # type: ignore[attr-defined]
            agree = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
            summary["same_tokens_as_llama.cpp"] = agree[0] if agree else len(a)
        print(json.dumps(summary), flush=True)
        for (q, name), run in runners.items():
            store = getattr(getattr(run, "lm", None), "provider", None)
            if q == quant and hasattr(store, "stats"):
                c = store.stats.totals()  # type: ignore[union-attr]
                print(json.dumps({"quant": quant, "engine": name, "expert_memory": args.expert_memory, "hit_rate":
                                  round((c.hits + c.prefetch_hits) / max(1, c.accesses), 3), "misses": c.misses}),
                      flush=True)  # fmt: skip
        rows.append((quant, medians, summary.get("moelane_vs_llama.cpp")))
    print(f"\n{'quant':<14}{'moelane':>10}{'compiled':>10}{'gguf':>10}{'llama.cpp':>11}{'ratio':>7}")
    for quant, m, ratio in rows:
        cells = [f"{m[k]:.1f}" if k in m else "-" for k in ("moelane", "moelane-compiled", "gguf", "llama.cpp")]
        shown = "-" if ratio is None else ratio
        print(f"{quant:<14}{cells[0]:>10}{cells[1]:>10}{cells[2]:>10}{cells[3]:>11}{shown:>7}")


if __name__ == "__main__":
    main()
