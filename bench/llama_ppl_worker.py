"""A llama.cpp perplexity worker for bench/perplexity_bench.py, run by any Python that has llama-cpp-python and numpy
(no torch needed), so the benchmark can drive a llama.cpp build of its own choosing (`--llama-python`).

    python bench/llama_ppl_worker.py MODEL.gguf WINDOWS.npy --threads 2 --vocab VOCAB.json \
        --check-text TEXT.txt --check-ids IDS.npy

WINDOWS.npy holds token ids [W, seq + 1]. For each window the worker evaluates its first `seq` ids in a fresh context
(no BOS: the ids are fed as they are, llama.cpp's tokenizer is not used) with `logits_all`, takes the logits of every
position (`Llama.scores`) and scores each next id: one JSON line with the summed negative log-likelihood (nats) and
the number of scored tokens per window. Since only ids cross, it checks that they mean the same tokens: VOCAB.json
(`--vocab`) lists each id's bytes (hex) in the model's tokenizer, and the worker counts the ids whose llama.cpp piece
differs (read with a buffer of 256 bytes: the binding's `detokenize` reads 32 and returns nothing for longer
tokens). With `--check-text` / `--check-ids` (the text's ids in the model's tokenizer) it also says whether
llama.cpp's own tokenizer gives the same ids.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def window_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed cross-entropy (nats) of `targets` [T] under `logits` [T, vocab], in float64."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(x - top).sum(axis=1))
    return float((log_z - x[np.arange(len(targets)), targets]).sum())


def piece(llm: object, token: int) -> bytes:
    """Token `token`'s bytes in llama.cpp's vocabulary (special tokens spelled out)."""
    import ctypes

    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, 256, 0, True)  # type: ignore[attr-defined]
    if n < 0:
        raise ValueError(f"token {token} is longer than 256 bytes")
    return buf.raw[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("windows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab", type=Path, help="JSON list: each id's bytes in hex, in the model's tokenizer")
    p.add_argument("--check-text", type=Path)
    p.add_argument("--check-ids", type=Path)
    args = p.parse_args()
    import llama_cpp

    windows = np.load(args.windows)
    seq = windows.shape[1] - 1
    # type_k / type_v 0: an f32 KV cache, so that the weights' precision is the only thing that differs
    llm = llama_cpp.Llama(args.model, n_ctx=seq, n_batch=seq, n_ubatch=seq, logits_all=True, n_threads=args.threads,
                          n_threads_batch=args.threads, type_k=0, type_v=0, use_mmap=True, verbose=False)  # fmt: skip
    out: dict[str, object] = {"n_vocab": llm.n_vocab()}
    if args.vocab is not None:
        ours = [bytes.fromhex(h) for h in json.loads(args.vocab.read_text())]
        differ = [i for i, b in enumerate(ours) if piece(llm, i) != b]
        out["vocab_ids_spelled_differently"] = len(differ) + abs(len(ours) - llm.n_vocab())
        out["vocab_differences"] = [[i, ours[i].hex(), piece(llm, i).hex()] for i in differ[:8]]
    if args.check_text is not None and args.check_ids is not None:
        text = args.check_text.read_text(encoding="utf-8")
        ids = np.load(args.check_ids).tolist()
        own = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        out["own_tokenizer_equal"] = own == ids
        out["own_tokenizer_first_difference"] = next(
            (i for i, (a, b) in enumerate(zip(own, ids, strict=False)) if a != b), min(len(own), len(ids))
        )
    nll, counts = [], []
    t0 = time.perf_counter()
    for w in windows:
        llm.reset()
        llm.eval(w[:-1].tolist())
        logits = np.asarray(llm.scores[:seq], dtype=np.float32)
        nll.append(window_nll(logits, w[1:]))
        counts.append(seq)
    out.update(nll=nll, tokens=counts, seconds=time.perf_counter() - t0)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
