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
GGML_TYPES = {"q4_0": 2, "q8_0": 8}  # GGML_TYPE_Q4_0 / _Q8_0


def quantize(
    src: Path, out: Path, kind: str, python: str = sys.executable, threads: int = 2, output: str | None = None
) -> Path:
    """Quantise the GGUF `src` to `kind` (q8_0, q4_0) with llama.cpp's own quantiser, as `llama-quantize` does (every
    2-D weight, the token embeddings too; norms and routers stay F32), through the llama-cpp-python binding of
    `python`. The output tensor (LM head) gets llama.cpp's own choice for `kind` (for Q4_0: Q6_K, or Q8_0 where its
    rows are not whole 256-blocks, as the shipped model's 192 are not) unless `output` names its type, as
    `llama-quantize --output-tensor-type` does."""
    if out.exists():
        return out
    code = (
        "import sys, llama_cpp\n"
        "params = llama_cpp.llama_model_quantize_default_params()\n"
        f"params.ftype, params.nthread = {FTYPES[kind]}, {threads}\n"
        + (f"params.output_tensor_type = {GGML_TYPES[output]}\n" if output is not None else "")
        + f"sys.exit(llama_cpp.llama_model_quantize({str(src).encode()!r}, {str(out).encode()!r}, params))\n"
    )
    if subprocess.run([python, "-c", code]).returncode != 0:
        raise SystemExit(f"llama.cpp could not quantise {src} to {kind}")
    return out
