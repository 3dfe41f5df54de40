"""A llama.cpp decode worker for the benchmarks, run by any Python that has llama-cpp-python (no torch needed), so a
benchmark can drive a llama.cpp build of its own choosing (`--llama-python`) and alternate it with moelane.

    python bench/llama_worker.py MODEL.gguf --threads 2 --tokens 64 --prompt 17,4242,99
reads one line per round on stdin and answers each with one JSON line: the decode tok/s of `tokens` greedy tokens
after the prompt (the first token, which the prompt's pass gives, not counted), and the tokens themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", required=True, help="token ids, comma-separated")
    args = p.parse_args()
    import llama_cpp

    prompt = [int(t) for t in args.prompt.split(",")]
    llm = llama_cpp.Llama(args.model, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, type_k=0,
                          type_v=0, use_mmap=True, verbose=False)  # fmt: skip
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        llm.reset()
        llm.eval(prompt)
        tokens = [llm.sample(temp=0.0)]
        t0 = time.perf_counter()
        for _ in range(args.tokens - 1):
            llm.eval([tokens[-1]])
            tokens.append(llm.sample(temp=0.0))
        tps = (args.tokens - 1) / (time.perf_counter() - t0)
        print(json.dumps({"decode_tok_s": tps, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
