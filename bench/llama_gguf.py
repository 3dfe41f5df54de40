"""Convert a Hugging Face model folder to GGUF with llama.cpp's own converter, for the benchmarks that run llama.cpp.

The converter refuses byte-level BPE tokenizers it does not recognise by hash; ours (the shipped model's, the bench
models') use the GPT-2 pre-tokenizer, so the shim declares them "gpt-2" and runs the converter unchanged.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def convert(folder: Path, out: Path, llama_cpp: Path, outtype: str = "f32") -> Path:
    """Write `folder` as GGUF to `out` (`outtype` f32 or bf16) with the converter in the llama.cpp tree `llama_cpp`."""
    if out.exists():
        return out
    tree = str(Path(llama_cpp).resolve())
    shim = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{tree!r}, {tree + '/gguf-py'!r}]\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        f"sys.argv = [{tree + '/convert_hf_to_gguf.py'!r}, {str(folder)!r}, '--outfile', {str(out)!r}, "
        f"'--outtype', {outtype!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", shim], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp conversion failed: {done.stderr.strip().splitlines()[-1:]}")
    return out


FTYPES = {"q8_0": 7, "q4_0": 2}  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0 / _Q4_0


def quantize(src: Path, out: Path, kind: str, threads: int = 2) -> Path:
    """Quantise the GGUF `src` to `kind` (q8_0, q4_0) with llama.cpp's own quantiser (llama-cpp-python's binding), as
    `llama-quantize` does: every 2-D weight but the token embeddings."""
    if out.exists():
        return out
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPES[kind], threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantise {src} to {kind}")
    return out
