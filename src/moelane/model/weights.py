"""Dense weights as the kernels read them (`moelane.kernels`).

After a model's weights load, each projection (every `nn.Linear` of the model: attention, dense MLPs, shared
experts, the LM head) can become a `kernels.Pool` of one matrix, which `layers.linear` multiplies with the kernels:
- quantised (`quantize="int8"` or `"int4"`): as a llama.cpp Q8_0 / Q4_0 file holds a model, so a decode step reads a
  half or a quarter of the bytes; embeddings stay as stored, and the LM head is int8 under "int4" too (`HEAD_KINDS`).
  `quantize="auto"` (the default) quantises nothing here: a GGUF's Q8_0 / Q4_0 projections arrive as pools of the
  file's own codes where the extension serves, its other block-quantised ones (K-quants: llama.cpp's Q4_0 files hold
  the LM head at Q6_K) as pools at their nearest tier (`holds_file_codes`, `load.fill_dense`), the rest go on as with
  "none";
- as they are, in bfloat16 or float32, where the C++ extension serves: it reads them at close to the memory's speed
  (float32 LM heads and projections took the shipped-size 115M model's compiled decode from 81 to 190 tok/s here)
  and reduces each row in a fixed order, where oneDNN's bf16 products gave a row other bits among other row counts
  on an AMX Xeon (docs/batch-invariance.md, docs/kernels.md). The Pool views the weight's own storage (no copy).
Without the extension unquantised weights stay tensors (F.linear on row tiles; its fallback is 25-70x slower). A tied
LM head that is quantised gets its own copy; the embeddings keep theirs. On the CPU each attention's q, k and v pools
are then joined into one where they are of one kind and width (`fuse_projections`): one product a step for three.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn

from moelane import kernels
from moelane.device import CPU
from moelane.errors import ModelLoadError
from moelane.kernels import hugepages
from moelane.model.derived import DenseCache

log = logging.getLogger(__name__)
QUANTIZE = ("auto", "none", "int8", "int4")
# The LM head's kind under each quantize: int8 under int4 too, as llama.cpp's Q4_0 files hold it at 6 or 8 bits
# (Q6_K, or Q8_0 where rows are not whole 256-blocks). On the shipped model an int4 head cost +0.66% perplexity of
# int4's +0.95% (docs/kernels.md "Quality"); it is a few percent of a MoE's bytes a token.
HEAD_KINDS = {"int8": "int8", "int4": "int8"}


def check_quantize(quantize: str) -> None:
    """ModelLoadError unless `quantize` is one of QUANTIZE."""
    if quantize not in QUANTIZE:
        raise ModelLoadError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")


def prepare_weights(
    model: nn.Module,
    quantize: str = "none",
    progress: bool = False,
    cache: DenseCache | None = None,
    device: torch.device = CPU,
) -> int:
    """Turn the model's projections into kernel pools as the module docstring says -> how many were turned. With
    `progress`, a line on stderr says so when the kernels must be compiled first (once per machine, ~10 s), and a bar
    counts the projections while they are quantised. "auto" is "none" here: a GGUF's block-quantised projections are
    already pools (`load.fill_dense`), and pools are left as they are. Quantised pools are taken from `cache` where
    it holds them, and written to it where it did not (`derived.DenseCache`). `device`: where the model will compute
    (pools are made on the CPU either way; `moelane.device.move` moves them)."""
    check_quantize(quantize)
    quantize = "none" if quantize == "auto" else quantize
    linears = {
        name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor)
    }
    if not linears or (not kernels_serve(device, progress) and quantize == "none"):
        return 0
    if quantize != "none":
        return quantise_projections(model, linears, quantize, progress, cache)
    n = 0
    for module in linears.values():
        if (kind := kernels.FLOAT_KINDS.get(module.weight.dtype)) is not None:
            replace(module, kernels.Pool(kind, module.weight.detach().contiguous()[None]))
            n += 1
    log.debug("%d projections read through the kernels", n)
    return n


def quantise_projections(
    model: nn.Module, linears: dict[str, nn.Linear], quantize: str, progress: bool, cache: DenseCache | None
) -> int:
    """prepare_weights' quantised case -> how many projections were turned."""
    head = getattr(model, "lm_head", None)
    kinds = {name: HEAD_KINDS[quantize] if m is head else quantize for name, m in linears.items()}
    wanted = {name: (kinds[name], *m.weight.shape) for name, m in linears.items()}
    cached = None if cache is None else cache.load(wanted)
    if cached is not None:
        for name, module in linears.items():
            replace(module, cached[name])
        log.debug("%d projections from the dense cache (%s)", len(linears), quantize)
        return len(linears)
    from tqdm import tqdm

    pools = {}
    bar = tqdm(linears.items(), desc=f"quantising dense weights to {quantize}", unit=" proj", leave=False,
               disable=not progress, delay=1.0, file=sys.stderr)  # fmt: skip
    with torch.no_grad():
        for name, module in bar:
            pools[name] = kernels.quantize(module.weight.detach().float()[None], kinds[name])
            replace(module, pools[name])
    if cache is not None:
        cache.save(pools)
    log.debug("%d projections quantised (%s)", len(pools), quantize)
    return len(pools)


def fuse_projections(model: nn.Module) -> int:
    """Each attention's q, k and v pools joined into one where they can be (`Attention.fuse_projections`: one
    product where there were three, the same bits) -> how many were joined."""
    n = sum(bool(fuse()) for m in model.modules() if callable(fuse := getattr(m, "fuse_projections", None)))
    log.debug("%d attentions read q, k and v in one product", n)
    return n


def replace(module: nn.Linear, pool: kernels.Pool) -> None:
    """`module` reads `pool` from now on, its bytes in huge-page memory (every pass streams them:
    kernels/hugepages.py)."""
    del module.weight  # (the Parameter; a plain attribute takes its place)
    module.weight = hugepages.place_pool(pool)  # type: ignore[assignment]


def holds_file_codes(quantize: str, progress: bool = False, device: torch.device = CPU) -> bool:
    """Whether a GGUF's block-quantised projections are held as kernel pools (Q8_0 / Q4_0 as the file's own codes,
    others at their nearest tier: `gguf.tensors.own_codes`): under "auto", where the C++ kernels serve (the PyTorch
    fallback computes from a pool far slower than `F.linear` from decoded weights, so there "auto" decodes them, as
    "none" does)."""
    return quantize == "auto" and kernels_serve(device, progress)


def kernels_serve(device: torch.device, progress: bool) -> bool:
    """Whether the kernels compute on `device` at their own speed (`kernels.serves`); on the CPU they are compiled
    first if this machine has no build of them yet (a line on stderr with `progress`)."""
    return build_kernels(progress).backend != "fallback" if device.type == "cpu" else kernels.serves(device)


def build_kernels(progress: bool) -> kernels.Availability:
    """The kernels, compiled first if this machine has no build of them yet (a line on stderr with `progress`)."""
    return kernels.ensure_built(on_compile=say if progress else None)


def say(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)
