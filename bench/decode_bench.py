"""Decode speed at batch 1: moelane (eager and compiled) against transformers and llama.cpp on the same model.

Builds a random qwen3_moe of ~115M params (vocab 32000, hidden 512, 8 layers, 32 experts, top-4, norm_topk_prob)
unless --model is given, then alternates the engines round by round and prints one JSON line per measurement and a
summary line with medians and ratios. llama.cpp runs only when `llama_cpp` is importable and a converter is found
(--llama-cpp DIR, the llama.cpp tree in llama-cpp-python's sdist); it uses an f32 KV cache.

    python bench/decode_bench.py --rounds 3 --tokens 128 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.helpers import save_model

import gguf

PROMPT = [17, 4242, 99, 1234, 5678, 31000, 12, 7, 8080, 4000, 15, 16]


def git_rev() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def build_model(folder: Path) -> Path:
    if (folder / "config.json").exists():
        return folder
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=192, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"event": "built", "params": n, "folder": str(folder)}), flush=True)
    save_model(model, folder, 32000)
    return folder


def moelane_runner(folder: Path, dtype: torch.dtype, compiled: bool, tokens: int) -> Callable[[], float]:
    import moelane

    lm = moelane.load(folder, dtype, compile=compiled)

    def run() -> float:
        gen = lm.generate_ids(PROMPT, tokens, stop_ids=frozenset())
        next(gen)  # prefill + first token
        t0 = time.perf_counter()
        n = sum(1 for _ in gen)
        return n / (time.perf_counter() - t0)

    run()  # warm-up (compiles when compiled)
    return run


def transformers_runner(folder: Path, dtype: torch.dtype, tokens: int) -> Callable[[], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype).eval()
    ids = torch.tensor([PROMPT])

    def run() -> float:
        with torch.no_grad():
            out = model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(tokens - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (tokens - 1) / (time.perf_counter() - t0)

    run()
    return run


def llama_runner(folder: Path, dtype: torch.dtype, tokens: int, llama_tree: str | None) -> Callable[[], float] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    outtype = "f32" if dtype == torch.float32 else "bf16"
    gguf_path = folder / f"model-{outtype}.gguf"
    if not gguf_path.exists() and not llama_tree:
        return None
    gguf.convert(folder, gguf_path, Path(llama_tree or "."), outtype)
    llm = llama_cpp.Llama(
        str(gguf_path), n_ctx=512, n_threads=torch.get_num_threads(), type_k=0, type_v=0, verbose=False
    )

    def run() -> float:
        llm.reset()
        llm.eval(PROMPT)
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        return (tokens - 1) / (time.perf_counter() - t0)

    run()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("/tmp/moelane-bench-qwen3moe-115m"))
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--llama-cpp", help="llama.cpp tree with convert_hf_to_gguf.py (vendor/llama.cpp in its sdist)")
    p.add_argument("--engines", default="moelane,moelane-compiled,transformers,llama.cpp")
    args = p.parse_args()
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    folder = build_model(args.model)
    wanted = args.engines.split(",")
    runners: dict[str, Callable[[], float]] = {}
    if "moelane" in wanted:
        runners["moelane"] = moelane_runner(folder, dtype, False, args.tokens)
    if "moelane-compiled" in wanted:
        t0 = time.perf_counter()
        runners["moelane-compiled"] = moelane_runner(folder, dtype, True, args.tokens)
        print(json.dumps({"event": "compiled", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    if "transformers" in wanted:
        runners["transformers"] = transformers_runner(folder, dtype, args.tokens)
    if "llama.cpp" in wanted and (run := llama_runner(folder, dtype, args.tokens, args.llama_cpp)) is not None:
        runners["llama.cpp"] = run
    results: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):
        for name, run in runners.items():
            tps = run()
            results[name].append(tps)
            print(
                json.dumps({"round": r, "engine": name, "dtype": args.dtype, "decode_tok_s": round(tps, 1)}), flush=True
            )
    medians = {name: statistics.median(v) for name, v in results.items()}
    summary: dict[str, object] = {
        "summary": True, "git": git_rev(), "dtype": args.dtype, "threads": torch.get_num_threads(),
        "tokens": args.tokens, "rounds": args.rounds, "median_tok_s": {k: round(v, 1) for k, v in medians.items()},
    }  # fmt: skip
    best = max((v for k, v in medians.items() if k.startswith("moelane")), default=None)
    for ref in ("transformers", "llama.cpp"):
        if best is not None and ref in medians:
            summary[f"moelane_vs_{ref}"] = round(best / medians[ref], 2)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
