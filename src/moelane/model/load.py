"""`load(path)`: a Hugging Face model folder, or a GGUF file -> `LM`, with experts left on disk for the provider to
fetch.

    config.json -> its family (`family.family_of`, by `model_type`) -> its typed config, checked (`config.Config`)
    -> the family's decoder -> the experts' disk handles -> (preflight) -> the dense weights read into the decoder -> LM

A GGUF's metadata stands in for config.json (`gguf.hparams`), its tensors for the shards (`gguf.tensors`: llama.cpp's
names and layouts mapped to the decoder's), its vocabulary for tokenizer.json (`gguf.vocab`): docs/gguf.md.

`preflight`, where given, sees the model's `MemoryNeeds` before any weight is read (a memory check refuses there).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelane.device import CPU, move
from moelane.errors import ModelLoadError
from moelane.model.checkpoint import (
    DTYPES,
    ExpertHandle,
    TensorRef,
    expected_shapes,
    fp8_to,
    read_config,
    read_eos_ids,
    read_tensor,
    read_tensor_into,
    scan_checkpoint,
)
from moelane.model.config import Config
from moelane.model.decoder import Decoder
from moelane.model.derived import DenseCache
from moelane.model.family import FAMILIES, Family, family_of
from moelane.model.gguf.file import GgufFile, is_gguf, open_gguf
from moelane.model.gguf.hparams import hf_config
from moelane.model.gguf.tensors import Dense, dense_tensors
from moelane.model.gguf.tensors import expert_handles as gguf_experts
from moelane.model.gguf.vocab import gguf_tokenizer, stop_ids
from moelane.model.lm import LM
from moelane.model.provider import ExpertProvider, ResidentProvider
from moelane.model.tokenizer import Tokenizer
from moelane.model.weights import check_quantize, fuse_projections, holds_file_codes, prepare_weights

__all__ = ["FAMILIES", "load"]
log = logging.getLogger(__name__)
ProviderFactory = Callable[[dict[int, list[ExpertHandle]], torch.dtype], ExpertProvider]


@dataclass(frozen=True, slots=True)
class MemoryNeeds:
    """What a model takes in memory besides its routed experts, known before any weight is read: `dense_bytes`, its
    dense weights in the compute dtype (as stored for float8 ones expanded; before `quantize`, an upper bound);
    `kv_bytes`, one stream's KV cache at the model's full context; `top_k`, experts a token routes to in each of
    its `n_moe_layers` MoE layers."""

    dense_bytes: int
    kv_bytes: int
    top_k: int
    n_moe_layers: int


Preflight = Callable[[MemoryNeeds, dict[int, list[ExpertHandle]], torch.dtype], None]


def load(
    path: str | Path | None = None,
    dtype: torch.dtype | str = torch.float32,
    *,
    provider: ProviderFactory | None = None,
    compile: bool = False,
    progress: bool = False,
    quantize: str = "auto",
    preflight: Preflight | None = None,
    device: torch.device = CPU,
) -> LM:
    """Load a model folder or a GGUF file (None: the shipped default model) to compute in `dtype` ("auto":
    `checkpoint_dtype`). `provider` builds the expert provider from the experts' handles (default: all experts
    resident). `compile` compiles the one-token decode step. `quantize` ("int8", "int4") holds the dense projections
    quantised (`weights.prepare_weights`); "auto" holds a GGUF's block-quantised projections as kernel pools where
    the kernels serve (`weights.holds_file_codes`, `fill_dense`), anything else as "none" does. `preflight` is
    called with the model's `MemoryNeeds`, its experts' handles and the compute dtype before any weight is read (a
    memory check that refuses early raises there). `device`: where the model computes (`moelane.device`): its dense
    weights are moved there once prepared; `provider` must put the experts there too."""
    check_quantize(quantize)
    folder, gguf_file, raw, family, config, compute = opened(path, dtype)
    fp8_block = check_quantization(config.quantization_config, family.quantized)
    model = family.build(config)
    if gguf_file is None:
        handles, tokenizer = read_folder(folder, family, config, model, raw, compute, fp8_block, preflight)
    else:
        own_codes = holds_file_codes(quantize, progress, device)
        handles, tokenizer = read_gguf(gguf_file, family, config, model, compute, preflight, own_codes)
    cache = DenseCache.of(folder, quantize, compute) if quantize in ("int8", "int4") else None
    prepare_weights(model, quantize, progress, cache, device)
    if device == CPU:  # (on a device, `move` would copy a fused pool and its views apart)
        fuse_projections(model)
    move(model, device)
    build_provider = provider or (lambda h, d: ResidentProvider.from_handles(h, d, progress=progress, device=device))
    lm = LM(folder, config, family, model, tokenizer, handles, build_provider(handles, compute), compute)
    if compile:
        lm.enable_compile()
    return lm


def opened(
    path: str | Path | None, dtype: torch.dtype | str
) -> tuple[Path, GgufFile | None, dict[str, Any], Family[Any], Config, torch.dtype]:
    """A model's folder, its GGUF file (or None), raw and typed config, family and compute dtype: nothing read but
    config.json (or the GGUF's metadata)."""
    if dtype != "auto" and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    if path is None:
        from moelane.assets import default_model_path

        path = default_model_path()
    folder = Path(path)
    gguf_file = open_gguf(folder) if is_gguf(folder) else None
    raw = hf_config(gguf_file) if gguf_file else read_config(folder)
    family = family_of(raw["model_type"])
    config = family.config_class.from_dict(raw)
    compute = checkpoint_dtype(config) if dtype == "auto" else dtype
    assert isinstance(compute, torch.dtype)
    return folder, gguf_file, raw, family, config, compute


def read_experts(
    path: str | Path | None = None, dtype: torch.dtype | str = torch.float32
) -> tuple[Config, Family[Any], dict[int, list[ExpertHandle]], torch.dtype]:
    """A model's config, family, routed experts' handles and compute dtype, without reading a weight: what a process
    that computes experts only needs (`moelane.dist`'s ranks but the first)."""
    folder, gguf_file, _, family, config, compute = opened(path, dtype)
    fp8_block = check_quantization(config.quantization_config, family.quantized)
    if gguf_file is None:
        handles = expert_handles(family, config, config.moe_layers(), scan_checkpoint(folder), fp8_block)
    else:
        handles = gguf_experts(gguf_file, config, config.moe_layers())
        check_expert_shapes(config, handles)
    return config, family, handles, compute


def read_folder(
    folder: Path, family: Family[Any], config: Config, model: Decoder, raw: dict[str, Any], dtype: torch.dtype,
    fp8_block: tuple[int, int] | None, preflight: Preflight | None = None,
) -> tuple[dict[int, list[ExpertHandle]], Tokenizer]:  # fmt: skip
    """A model folder's experts (handles) and tokenizer, its dense weights read into `model`."""
    refs = scan_checkpoint(folder)
    handles = expert_handles(family, config, model.moe_layers, refs, fp8_block)
    # (a fused checkpoint's stacked tensor starts where its first expert's slice does)
    expert_starts = {(ref.path, ref.offset) for hs in handles.values() for h in hs for ref in h.tensors.values()}
    dense = {
        name: ref
        for name, ref in refs.items()
        if (ref.path, ref.offset) not in expert_starts and not family.ignored(config, name)
    }
    if preflight is not None:
        n_dense = sum(ref.nbytes // max(1, DTYPES[ref.dtype].itemsize) for ref in dense.values())
        preflight(memory_needs(config, model, n_dense, dtype), handles, dtype)
    load_dense(model, family, dense, dtype, fp8_block)
    return handles, Tokenizer(folder, read_eos_ids(folder, family.config_class.prepare(raw)))


def read_gguf(
    f: GgufFile, family: Family[Any], config: Config, model: Decoder, dtype: torch.dtype,
    preflight: Preflight | None = None, own_codes: bool = False,
) -> tuple[dict[int, list[ExpertHandle]], Tokenizer]:  # fmt: skip
    """A GGUF's experts (handles into the file) and tokenizer, its dense weights decoded into `model` (with
    `own_codes`, its block-quantised projections held as kernel pools: `fill_dense`)."""
    handles = gguf_experts(f, config, model.moe_layers)
    check_expert_shapes(config, handles)
    dense = dense_tensors(f, config, model)
    if preflight is not None:
        preflight(memory_needs(config, model, sum(math.prod(d.shape) for d in dense.values()), dtype), handles, dtype)
    fill_dense(model, family, dense, dtype, own_codes)
    tok, tokenizer_config = gguf_tokenizer(f, config.vocab_size)
    return handles, Tokenizer.built(tok, tokenizer_config, stop_ids(f.metadata))


def memory_needs(config: Config, model: Decoder, n_dense: int, dtype: torch.dtype) -> MemoryNeeds:
    """The model's `MemoryNeeds` from its config, its decoder's cache shapes and its `n_dense` dense values."""
    per_position = sum(heads * (k_dim + v_dim) for heads, k_dim, v_dim in model.cache_shapes().values())
    top_k = config.top_k or 0
    return MemoryNeeds(n_dense * dtype.itemsize, per_position * dtype.itemsize * config.max_position_embeddings, top_k,
                     len(model.moe_layers))  # fmt: skip


def check_quantization(quant: dict[str, Any] | None, readable: tuple[str, ...] = ()) -> tuple[int, int] | None:
    """The block of a float8 checkpoint's weight scales (DeepSeek's, Qwen's, GLM's and MiniMax's FP8 releases:
    `quant_method` "fp8", e4m3 weights, `weight_block_size`, activations quantized on the fly, which moelane does
    not: it computes with the weights expanded to the compute dtype, as transformers does without a GPU), or None.
    Other checkpoints quantized by another tool (GPTQ, AWQ, bitsandbytes, per-tensor FP8: config.json's
    `quantization_config`) are refused in one line, before their packed tensors fail as missing or odd ones; except
    the `readable` methods, whose experts the family reads (gpt-oss: mxfp4)."""
    if quant is None:
        return None
    method = quant.get("quant_method", "unknown")
    if method in readable:
        return None
    if method == "fp8":
        block = quant.get("weight_block_size")
        e4m3 = quant.get("fmt", "e4m3") in ("e4m3", "float8_e4m3fn")  # (MiniMax's spelling of the same format)
        dynamic = quant.get("activation_scheme", "dynamic") == "dynamic"
        fine = isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
        if isinstance(block, list) and fine and e4m3 and dynamic:
            return block[0], block[1]
        raise ModelLoadError(f"fp8 checkpoints are read with e4m3 weights in blocks of scales only "
                             f"(weight_block_size), got {json.dumps(quant)[:200]}")  # fmt: skip
    raise ModelLoadError(f"quantized checkpoints are not supported (quantization_config: {method}); use the "
                         "model's bf16 or fp32 weights, or its fp8 ones with block scales: moelane quantizes experts "
                         "itself (--default-tier int8 or int4)")  # fmt: skip


def checkpoint_dtype(config: Config) -> torch.dtype:
    """The dtype "auto" computes in: bfloat16 for a checkpoint saved in bfloat16 (config.json's `dtype`, or
    `torch_dtype` as transformers 4 wrote it), float32 otherwise (float16 checkpoints too: half-precision matrix
    products are slow or missing on CPUs). A config's `moelane_compute_dtype` overrides that: the shipped models are
    stored in bfloat16 for size but were trained, and are meant to run, in float32."""
    meant = config.moelane_compute_dtype
    saved = meant if meant in ("float32", "bfloat16") else config.dtype
    return torch.bfloat16 if saved == "bfloat16" else torch.float32


def expert_handles(
    family: Family[Any],
    config: Config,
    moe_layers: list[int],
    refs: dict[str, TensorRef],
    fp8_block: tuple[int, int] | None = None,
) -> dict[int, list[ExpertHandle]]:
    handles: dict[int, list[ExpertHandle]] = {}
    for layer in moe_layers:
        prefix = family.expert_prefix(layer)
        found = family.find_experts(refs, prefix, config.n_experts, fp8_block)
        if found is None:
            raise ModelLoadError(f"checkpoint has no experts for MoE layer {layer} ({prefix}.*)")
        handles[layer] = found
    check_expert_shapes(config, handles)
    return handles


def check_expert_shapes(config: Config, handles: dict[int, list[ExpertHandle]]) -> None:
    for layer_handles in handles.values():
        for h in layer_handles:
            expect = expected_shapes(h.layout, config.hidden_size, config.moe_width, h.block)
            for name, ref in h.tensors.items():
                if ref.dtype.startswith("F8") and h.layout != "fp8":
                    raise ModelLoadError(f"expert {h.expert} of layer {h.layer}: float8 {name} weights without "
                                         "block scales (weight_scale_inv, weight_block_size)")  # fmt: skip
                if ref.value_shape != expect[name]:
                    raise ModelLoadError(
                        f"expert {h.expert} of layer {h.layer}: {name} has shape {list(ref.value_shape)}, "
                        f"config.json implies {list(expect[name])} ({ref.path})"
                    )


def load_dense(
    model: Decoder, family: Family[Any], refs: dict[str, TensorRef], dtype: torch.dtype,
    fp8_block: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """Read the dense tensors one at a time straight into the model's parameters (peak memory: the model plus one
    tensor, not a second copy of every weight); float8 weights expanded with their scales (`fp8_block`)."""
    refs = family.sanitize(refs)  # renames only
    scales = {
        name.removesuffix("_scale_inv"): refs.pop(name) for name in list(refs) if name.endswith(".weight_scale_inv")
    }
    cast(model, family, dtype)
    own = model.state_dict()
    for name, ref in refs.items():
        if name in own and tuple(own[name].shape) != ref.shape:
            raise ModelLoadError(
                f"tensor {name} has shape {list(ref.shape)}, config.json implies {list(own[name].shape)}"
            )
    unexpected = sorted(set(refs) - set(own))
    if unexpected:
        log.warning("ignoring %d checkpoint tensors the model does not use (e.g. %s)", len(unexpected), unexpected[0])
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    missing = sorted(set(own) - set(refs) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[0]}")
    head = refs.pop("lm_head.weight", None) if tied else None
    unscaled = next(
        (n for n, ref in refs.items() if ref.dtype.startswith("F8") and (n not in scales or not fp8_block)), None
    )
    if unscaled is not None:
        raise ModelLoadError(f"float8 tensor {unscaled} has no block scales (its weight_scale_inv, and "
                             "quantization_config's weight_block_size)")  # fmt: skip
    with torch.no_grad():
        for name, ref in refs.items():
            if name in scales and fp8_block is not None:
                own[name].copy_(fp8_to(read_tensor(ref), read_tensor(scales[name]), fp8_block, own[name].dtype))
            elif name in own:
                read_tensor_into(ref, own[name])
        if head is not None:
            untie_if_different(model, head)
    model.eval()


def cast(model: Decoder, family: Family[Any], dtype: torch.dtype) -> None:
    """The decoder's tensors to `dtype`, those the family keeps in fp32 (routers) to fp32."""
    model.to(dtype)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith(family.keep_fp32):
            tensor.data = tensor.data.float()


def fill_dense(
    model: Decoder, family: Family[Any], tensors: dict[str, Dense], dtype: torch.dtype, own_codes: bool = False
) -> None:
    """A GGUF's dense tensors (`gguf.tensors.dense_tensors`: one for each of the model's, by its names) decoded
    into the model one at a time; shapes checked before anything is read. With `own_codes`, a projection's
    block-quantised matrix (and a tied LM head's, from the embeddings') becomes a kernels pool instead: a Q8_0 / Q4_0
    one of the file's codes, never decoded; another type's at its nearest tier (`Dense.codes`; the embeddings
    themselves are decoded)."""
    cast(model, family, dtype)
    own = model.state_dict()
    for name, tensor in tensors.items():
        if tuple(own[name].shape) != tensor.shape:
            raise ModelLoadError(f"tensor {name} has shape {list(tensor.shape)} in the GGUF, its metadata implies "
                                 f"{list(own[name].shape)}")  # fmt: skip
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        for name, tensor in tensors.items():
            projection = projection_of(model, name)
            if own_codes and tensor.codes is not None and projection is not None:
                del own[name], projection.weight  # (the Parameter's memory goes)
                projection.weight = tensor.codes()  # type: ignore[assignment]
            else:
                own[name].copy_(tensor.read())
        embedding = tensors.get("model.embed_tokens.weight")
        if own_codes and tied and embedding is not None and embedding.codes is not None:
            del model.lm_head.weight
            model.lm_head.weight = embedding.codes()  # type: ignore[assignment]
    model.eval()


def projection_of(model: Decoder, name: str) -> nn.Linear | None:
    """The `nn.Linear` whose weight the state's tensor `name` is, else None."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module if attr == "weight" and isinstance(module, nn.Linear) else None


def untie_if_different(model: Decoder, head: TensorRef) -> None:
    """A config that ties the LM head to the embeddings but a checkpoint that also holds `lm_head.weight`: as in
    transformers, the checkpoint's head is used, so the weights stay shared only where the two are equal."""
    weight = read_tensor(head, model.lm_head.weight.dtype)
    if not torch.equal(weight, model.model.embed_tokens.weight):
        log.warning("config.json ties the LM head to the embeddings, but the checkpoint's lm_head differs: using it")
        model.lm_head.weight = torch.nn.Parameter(weight)
