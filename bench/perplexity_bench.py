"""Held-out perplexity of a model in moelane at each precision, next to llama.cpp's on the same token windows.

    python train/corpus.py              # train/data/<domain>.heldout.txt: the training corpus's held-out split
    python bench/perplexity_bench.py --llama-cpp LLAMA_CPP_TREE --llama-python /path/to/venv/bin/python

The model is the shipped default (`--model` for another folder). The held-out text of each domain (`--data`) is
tokenized with the model's own tokenizer (documents split at `<|endoftext|>`, encoded, each followed by that token,
as train/tokenizer.py encodes the corpus), and `--windows` windows of `--seq` + 1 ids are spread evenly over each
domain, as train/analyze.py spreads them (the defaults give the windows of MODEL_CARD.md's perplexity table). Each
window's first `--seq` ids are one fresh sequence; every position's logits score the next id. Both engines get the
same ids: moelane through `LM.logits`, llama.cpp (llama-cpp-python with `logits_all`, an f32 KV cache, in a worker
process under `--llama-python`: bench/llama_ppl_worker.py) through `Llama.eval` and `Llama.scores`. llama.cpp's
tokenizer is not needed: no BOS is added, and the worker checks that the GGUF's vocabulary spells every id as the
model's tokenizer does. Cross-entropy is computed in float64 with numpy by the same function for both.

Precisions (moelane -> llama.cpp GGUFs, made with llama.cpp's own converter and quantiser into `--gguf-dir`):
native (float32) -> F32, bf16 -> BF16, experts int8 / int4 (`default_tier`, the rest native) -> none, int8 (all
weights: `quantize` too) -> Q8_0, int4 (all weights) -> Q4_0 as llama.cpp makes it (its LM head at Q8_0 here, as
moelane's int4 holds it) and Q4_0 with the LM head at Q4_0 too. Embeddings: moelane keeps them as stored (in the
compute dtype), llama.cpp's Q8_0 / Q4_0 quantise them. Prints one JSON line per measurement (with per-domain
perplexities, and the GGUF's tensor types), then a markdown table. "bytes" is what each engine holds: moelane's
weights in memory after loading (every tensor storage the model reaches, once), llama.cpp's GGUF file.

`--moelane-gguf` also runs moelane on each GGUF file llama.cpp runs (engine `moelane-gguf`), as `moelane run --model
x.gguf` loads it, computing in float32: Q8_0 / Q4_0 experts and projections (the LM head too) held as the file's own
codes (`--default-tier auto`, `--quantize auto`), embeddings, norms, routers and F32 / BF16 tensors decoded exactly to
float32. Its perplexity is set against llama.cpp's on the same file and windows (the table's last columns), so the
weights are the same bit for bit and what differs is the arithmetic. `--no-folder` skips moelane on the model
folder (its own precisions), for a model whose GGUFs are all that is compared. The GGUFs are found in `--gguf-dir`
as `<model folder name>-<kind>.gguf` (kinds: f32, bf16, q8_0, q4_0, q4_0-out-q4_0), or made there with `--llama-cpp`:

    python bench/perplexity_bench.py --model inflated-8192 --quant int8,int4 --no-folder --moelane-gguf \
        --gguf-dir gguf --llama-cpp LLAMA_CPP_TREE --llama-python PY --windows 32
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_gguf
from llama_ppl_worker import window_nll
from revision import git_rev

ROOT = Path(__file__).resolve().parents[1]
DOMAINS = ("code", "shakespeare", "vimdoc")
EOT = "<|endoftext|>"


@dataclass(frozen=True)
class Precision:
    """One moelane precision: its load settings, and the llama.cpp GGUFs it is set against (none: no match)."""

    label: str
    dtype: torch.dtype
    default_tier: str
    quantize: str
    gguf: tuple[str, ...] = ()


PRECISIONS = {
    "native": Precision("native (float32)", torch.float32, "native", "none", ("f32",)),
    "bf16": Precision("bf16", torch.bfloat16, "native", "none", ("bf16",)),
    "experts-int8": Precision("experts int8", torch.float32, "int8", "none"),
    "experts-int4": Precision("experts int4", torch.float32, "int4", "none"),
    "int8": Precision("int8 (all weights)", torch.float32, "int8", "int8", ("q8_0",)),
    # llama.cpp's Q4_0 file holds the LM head at Q8_0 here (its Q6_K needs rows of whole 256-blocks), as moelane's
    # int4 holds it (model/weights.py HEAD_KINDS); the second GGUF, Q4_0 with the LM head at Q4_0 too, shows the head's
    # share
    "int4": Precision("int4 (all weights)", torch.float32, "int4", "int4", ("q4_0", "q4_0-out-q4_0")),
}


def vocab_bytes(tok: Tokenizer) -> list[str]:
    """Each id's bytes (hex) in a byte-level BPE tokenizer: its token read through GPT-2's byte alphabet; a special
    token as spelled."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    out = []
    for i in range(tok.get_vocab_size()):
        token = tok.id_to_token(i)
        out.append(token.encode().hex() if token in specials else bytes(alphabet[c] for c in token).hex())
    return out


def heldout_windows(folder: Path, data: Path, n: int, seq: int) -> tuple[dict[str, np.ndarray], str, list[int]]:
    """Per domain, `n` windows [n, seq + 1] of held-out ids spread evenly over its split; and a check text with its
    ids (the start of each domain's first held-out document)."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    out, check = {}, []
    for d in DOMAINS:
        path = data / f"{d}.heldout.txt"
        if not path.exists():
            raise SystemExit(f"{path} not found: run train/corpus.py (see train/README.md)")
        docs = path.read_text(encoding="utf-8").split(EOT)
        ids: list[int] = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eot)
        arr = np.asarray(ids, dtype=np.int64)
        if len(arr) < seq + 1:
            raise SystemExit(f"{path} holds {len(arr)} tokens, fewer than a window of {seq + 1}")
        starts = np.linspace(0, len(arr) - seq - 1, n).astype(np.int64)
        out[d] = arr[starts[:, None] + np.arange(seq + 1)[None, :]]
        check.append(docs[0][:2000])
    text = "\n".join(check)
    return out, text, tok.encode(text, add_special_tokens=False).ids


def held_bytes(lm: object) -> int:
    """Bytes of every tensor storage reachable from the loaded model (weights, pools, scales, tables), each once."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [lm]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None) | torch.dtype):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        if isinstance(obj, torch.nn.Module):
            stack.extend(obj.parameters(recurse=False))
            stack.extend(obj.buffers(recurse=False))
            stack.extend(obj.children())
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
        for name in getattr(type(obj), "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                stack.append(getattr(obj, name))
    return sum(storages.values())


# moelane on a GGUF file as `moelane run --model x.gguf` loads it (Q8_0 / Q4_0 held as the file's codes), in float32
AS_READ = Precision("moelane on the GGUF", torch.float32, "auto", "auto")


def moelane_ppl(path: Path | None, p: Precision, windows: dict[str, np.ndarray]) -> dict[str, object]:
    """moelane's negative log-likelihoods of `windows` with the model at `path` (a folder, a GGUF file; None: the
    shipped default model) loaded at precision `p`, the bytes it holds, and its load and evaluation seconds."""
    import moelane

    t0 = time.perf_counter()
    lm = moelane.load(path, p.dtype, default_tier=p.default_tier, quantize=p.quantize)
    loaded = time.perf_counter() - t0
    nbytes = held_bytes(lm)  # (before any pass: no KV cache yet)
    nll: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for d, w in windows.items():
        nll[d] = [window_nll(lm.logits(x[:-1].tolist()).float().numpy(), x[1:]) for x in w]
    lm.close()
    return {"bytes": nbytes, "nll": nll, "load_s": round(loaded, 1), "eval_s": round(time.perf_counter() - t0, 1)}


def gguf_file(folder: Path, kind: str, gguf_dir: Path, llama_tree: Path | None, python: str) -> Path | None:
    """The model as a GGUF of `kind` in `gguf_dir` (`<folder name>-<kind>.gguf`): found there, or made with
    llama.cpp's own converter (f32, bf16) and quantiser (q8_0, q4_0 from the bf16 conversion, which holds the
    checkpoint's weights exactly; `q4_0-out-q4_0`: its LM head at Q4_0 too), or None without a llama.cpp tree."""
    out = gguf_dir / f"{folder.name}-{kind}.gguf"
    if out.exists() or llama_tree is None:
        return out if out.exists() else None
    gguf_dir.mkdir(parents=True, exist_ok=True)
    base, _, output = kind.partition("-out-")
    if base in llama_gguf.FTYPES:
        bf16 = llama_gguf.convert(folder, gguf_dir / f"{folder.name}-bf16.gguf", llama_tree, "bf16")
        return llama_gguf.quantize(bf16, out, base, python, output=output or None)
    return llama_gguf.convert(folder, out, llama_tree, kind)


def gguf_label(kind: str, types: dict[str, int]) -> str:
    """`Q4_0`, with the LM head's type where it differs or was chosen (`Q4_0, LM head Q8_0`)."""
    main, _, chosen = kind.partition("-out-")
    head = next((k.split(":")[1] for k in types if k.startswith("output.weight:")), chosen.upper() or main.upper())
    return main.upper() if head == main.upper() and not chosen else f"{main.upper()}, LM head {head}"


def gguf_types(path: Path) -> dict[str, int]:
    """How many of the GGUF's tensors (by role: the name without its layer number) are stored at each type, read with
    the `gguf` package moelane reads GGUFs with."""
    from gguf import GGUFReader

    counts: Counter[str] = Counter()
    for t in GGUFReader(str(path)).tensors:
        role = ".".join(part for part in t.name.split(".") if not part.isdigit())
        counts[f"{role}:{t.tensor_type.name}"] += 1
    return dict(sorted(counts.items()))


def llama_ppl(path: Path, python: str, windows: dict[str, np.ndarray], check: tuple[str, list[int], list[str]],
              tmp: Path, threads: int) -> dict[str, object]:  # fmt: skip
    np.save(tmp / "windows.npy", np.concatenate(list(windows.values())))
    (tmp / "check.txt").write_text(check[0], encoding="utf-8")
    np.save(tmp / "check.npy", np.asarray(check[1], dtype=np.int64))
    (tmp / "vocab.json").write_text(json.dumps(check[2]))
    cmd = [python, str(Path(__file__).parent / "llama_ppl_worker.py"), str(path), str(tmp / "windows.npy"),
           "--threads", str(threads), "--vocab", str(tmp / "vocab.json"), "--check-text", str(tmp / "check.txt"),
           "--check-ids", str(tmp / "check.npy")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the llama.cpp worker on {path} failed: {done.stderr.strip()[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    flat, nll, first = answer.pop("nll"), {}, 0
    for d, w in windows.items():
        nll[d] = flat[first : first + len(w)]
        first += len(w)
    answer.pop("tokens")
    answer["seconds"] = round(answer["seconds"], 1)
    return {"bytes": path.stat().st_size, "nll": nll, **answer}


def perplexities(nll: dict[str, list[float]], seq: int) -> tuple[float, dict[str, float]]:
    """Over all windows, and per domain."""
    per = {d: math.exp(sum(v) / (len(v) * seq)) for d, v in nll.items()}
    total = sum(sum(v) for v in nll.values()) / (seq * sum(len(v) for v in nll.values()))
    return math.exp(total), per


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (default: the shipped default model)")
    p.add_argument("--data", type=Path, default=ROOT / "train/data", help="folder of <domain>.heldout.txt")
    p.add_argument("--windows", type=int, default=128, help="windows per domain (128: as MODEL_CARD.md's table)")
    p.add_argument("--seq", type=int, default=256, help="tokens a window feeds (it scores as many)")
    p.add_argument("--quant", default=",".join(PRECISIONS), help=f"comma-separated: {', '.join(PRECISIONS)}")
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp tree with convert_hf_to_gguf.py (vendor/llama.cpp in "
                   "llama-cpp-python's sdist); without it llama.cpp runs only on GGUFs in --gguf-dir")  # fmt: skip
    p.add_argument("--gguf-dir", type=Path, default=Path("/tmp/moelane-ppl-gguf"),
                   help="GGUFs of the model, named <model folder name>-<kind>.gguf")  # fmt: skip
    p.add_argument("--llama-python", default=sys.executable, help="the Python whose llama-cpp-python runs llama.cpp")
    p.add_argument("--no-llama", action="store_true", help="no llama.cpp")
    p.add_argument("--moelane-gguf", action="store_true", help="also run moelane on each GGUF file llama.cpp runs")
    p.add_argument("--no-folder", action="store_true", help="no moelane on the model folder (its own precisions)")
    args = p.parse_args()
    torch.manual_seed(0)
    from moelane.assets import default_model_path

    folder = (args.model or default_model_path()).resolve()
    windows, check_text, check_ids = heldout_windows(folder, args.data, args.windows, args.seq)
    check = (check_text, check_ids, vocab_bytes(Tokenizer.from_file(str(folder / "tokenizer.json"))))
    common = {"git": git_rev(), "model": folder.name, "windows": {d: len(w) for d, w in windows.items()},
              "seq": args.seq, "threads": torch.get_num_threads()}  # fmt: skip
    print(json.dumps({"event": "windows", **common, "tokens": args.seq * sum(len(w) for w in windows.values())}),
          flush=True)  # fmt: skip
    names = args.quant.split(",")
    if unknown := [n for n in names if n not in PRECISIONS]:
        raise SystemExit(f"unknown precision {unknown[0]!r}: use {', '.join(PRECISIONS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            prec = PRECISIONS[name]
            row: dict = {"name": name, "label": prec.label, "bytes": None, "ppl": None, "files": []}
            if not args.no_folder:
                ours = moelane_ppl(args.model, prec, windows)
                row["ppl"] = report("moelane", name, ours, args.seq, common)
                row["bytes"] = ours["bytes"]
            for kind in prec.gguf if args.moelane_gguf or not args.no_llama else ():
                path = gguf_file(folder, kind, args.gguf_dir, args.llama_cpp, args.llama_python)
                if path is not None:
                    row["files"].append(measure_file(path, kind, args, windows, check, Path(tmp), common))
            rows.append(row)
    print_table(rows)


def measure_file(path: Path, kind: str, args: argparse.Namespace, windows: dict[str, np.ndarray],
                 check: tuple[str, list[int], list[str]], tmp: Path, common: dict) -> dict:  # fmt: skip
    """llama.cpp's perplexity on the GGUF `path` (of `kind`) and, with `--moelane-gguf`, moelane's on the same file:
    one JSON line each, and the table's cells (None: not run)."""
    types = gguf_types(path)
    label = gguf_label(kind, types)
    cells: dict = {"label": label, "bytes": path.stat().st_size, "ppl": None, "gguf_bytes": None, "gguf_ppl": None}
    extra = {"tensor_types": types, "gguf": str(path)}
    if not args.no_llama:
        theirs = llama_ppl(path, args.llama_python, windows, check, tmp, torch.get_num_threads())
        cells["ppl"] = report("llama.cpp", label, {**theirs, **extra}, args.seq, common)
    if args.moelane_gguf:
        ours = moelane_ppl(path, AS_READ, windows)
        cells["gguf_ppl"] = report("moelane-gguf", label, {**ours, **extra}, args.seq, common)
        cells["gguf_bytes"] = ours["bytes"]
    return cells


def report(engine: str, precision: str, measured: dict[str, object], seq: int, common: dict) -> float:
    """Print one measurement as a JSON line (its negative log-likelihoods as perplexities); return its perplexity."""
    ppl, per = perplexities(measured.pop("nll"), seq)  # type: ignore[arg-type]
    print(json.dumps({"engine": engine, "precision": precision, "ppl": round(ppl, 4),
                      "ppl_per_domain": {d: round(v, 3) for d, v in per.items()}, **measured, **common}),
          flush=True)  # fmt: skip
    return ppl


def print_table(rows: list[dict]) -> None:
    """One line per (moelane precision, GGUF) pair; a precision without a GGUF gets one line of its own. Where
    moelane ran on the GGUF files too, three more columns: what it holds, its perplexity, and that against llama.cpp's
    on the same file."""
    native = next((r["ppl"] for r in rows if r["name"] == "native"), None)
    f32 = next((f["ppl"] for r in rows for f in r["files"] if f["label"] == "F32"), None)
    on_file = any(f["gguf_ppl"] is not None for r in rows for f in r["files"])
    print(
        "\n| moelane precision | bytes | moelane ppl | vs native | llama.cpp | bytes | llama.cpp ppl | vs F32 "
        "| moelane vs llama.cpp |" + (" moelane on the GGUF: bytes | ppl | vs llama.cpp |" if on_file else "")
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if on_file else ""))
    for r in rows:
        ours = f"{r['label']} | {mib(r['bytes'])} | {num(r['ppl'])} | {pct(r['ppl'], native)}"
        for f in r["files"] or [None]:
            if f is None:
                print(f"| {ours} | - | - | - | - | - |" + (" - | - | - |" if on_file else ""))
                continue
            line = (f"| {ours} | {f['label']} | {mib(f['bytes'])} | {num(f['ppl'])} | {pct(f['ppl'], f32)} "
                    f"| {pct(r['ppl'], f['ppl'])} |")  # fmt: skip
            if on_file:
                line += f" {mib(f['gguf_bytes'])} | {num(f['gguf_ppl'])} | {pct(f['gguf_ppl'], f['ppl'])} |"
            print(line)


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def pct(value: float | None, reference: float | None) -> str:
    """`value` relative to `reference` in %, signed; "-" where either is missing."""
    return "-" if value is None or reference is None else f"{100 * (value / reference - 1):+.2f}%"


if __name__ == "__main__":
    main()
