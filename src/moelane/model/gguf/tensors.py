"""A GGUF's tensors as the decoder's: names, layouts, and the experts' handles.

Names: each tensor the decoder holds is looked up under the name llama.cpp's converter gives it, asked of the
converter's own table (`gguf.get_tensor_name_map`: `model.layers.3.self_attn.q_proj.weight` is `blk.3.attn_q.weight`).
Where the converter changes a tensor on the way, the change is undone here (docs/gguf.md#layouts):
- llama-architecture files (Mixtral) hold q and k with each head's rotary halves interleaved (the converter's
  `permute`, for ggml's rope over pairs): the rows are put back in halves;
- DeepSeek's `kv_b_proj` is split per head into `attn_k_b` (transposed) and `attn_v_b`: joined back;
- gpt-oss's interleaved gate/up biases are split into gate and up: interleaved back;
- the router's score bias is `exp_probs_b.bias`.
A Q8_0 / Q4_0 matrix whose rows are the decoder's (renamed, or only reordered, as Llama's q and k are) can also be read
as a kernels pool of its own codes (`Dense.codes`, for `--quantize auto`); a matrix of another block type with a
nearest tier (K-quants, Q5_0, ...: `blocks.NEAREST_TIER`), as a pool of its decoded values requantised once to that
tier, as its experts are (llama.cpp's Q4_0 files hold the LM head at Q6_K: decoded to float, it alone read more
bytes a token than every other weight together on a 2048-wide model). DeepSeek's joined `kv_b_proj` is neither
(its `attn_k_b` half is transposed, which cuts across the blocks), and is decoded.

Experts: each MoE layer's stacked `ffn_{gate,up,down}_exps` [E, rows, cols] (or the fused `ffn_gate_up_exps`) give
every expert a `TensorRef` of its own slice, byte offsets into the file, so the provider and the pager read one expert
at a time with positioned reads, as from a fused safetensors checkpoint; nothing is read here. Float experts are layout
"linear" (read straight into a pool slot when their dtype is the pool's); block-quantised ones are layout "gguf",
decoded as each is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gguf
import torch

from moelane.errors import ModelLoadError
from moelane.kernels.pool import Pool, quantize
from moelane.model.checkpoint import DTYPES, ExpertHandle, TensorRef, read_tensor, slice_stacked
from moelane.model.config import Config
from moelane.model.decoder import Decoder
from moelane.model.gguf.blocks import FLOAT_TYPES, NEAREST_TIER, is_block_type
from moelane.model.gguf.codes import CODE_TIERS, matrix_pool
from moelane.model.gguf.file import GgufFile
from moelane.model.provider import TIER_KINDS

# Shape alphabet: E experts, H heads, R rows of a head, L latent (kv_lora_rank), N no-rope dims, V value dims.


@dataclass(frozen=True, slots=True)
class Dense:
    """One tensor of the decoder, from the GGUF: the shape of its values and how to read them (float32); for a
    block-quantised matrix, how to read it as a kernels pool (`codes`, else None: `own_codes`)."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    codes: Callable[[], Pool] | None = None


def dense_tensors(f: GgufFile, config: Config, model: Decoder) -> dict[str, Dense]:
    """Every tensor of `model`'s state (the tied head's once), by the decoder's names; ModelLoadError naming the first
    the file lacks, or holds in a type moelane cannot read."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch_enum(f.arch)], f.metadata[f"{f.arch}.block_count"])
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    out = {}
    for name in model.state_dict():
        if tied and name == "lm_head.weight":
            continue
        special = SPECIAL.get(name.removesuffix(".weight").rsplit(".", 1)[-1])
        out[name] = special(f, config, name) if special else renamed(f, config, name, names)
    return out


def arch_enum(arch: str) -> str:
    """The `gguf.MODEL_ARCH` member of an architecture name ("gpt-oss" -> "GPT_OSS")."""
    return next(member.name for member, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def renamed(f: GgufFile, config: Config, name: str, names: gguf.TensorNameMap) -> Dense:
    theirs = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if theirs is None:
        raise ModelLoadError(f"no GGUF tensor name for {name} in a {f.arch} file")
    if theirs not in f.tensors and f"{theirs}.weight" in f.tensors:  # (gpt-oss's sinks: `attn_sinks.weight`)
        theirs = f"{theirs}.weight"
    ref = tensor(f, theirs)
    if f.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.n_kv_heads
        return Dense(ref.value_shape, lambda: rotary_halves(values(ref, theirs), heads),
                     own_codes(ref, theirs, lambda blocks: rotary_halves(blocks, heads)))  # fmt: skip
    return Dense(ref.value_shape, lambda: values(ref, theirs), own_codes(ref, theirs))


def tensor(f: GgufFile, name: str) -> TensorRef:
    """The file's tensor `name`, of a type moelane reads; else ModelLoadError naming it."""
    ref = f.tensors.get(name)
    if ref is None:
        raise ModelLoadError(f"GGUF file has no tensor {name} ({f.path.name})")
    if ref.dtype not in FLOAT_TYPES and not is_block_type(ref.dtype):
        raise ModelLoadError(
            f"GGUF tensor {name} has type {ref.dtype}, which moelane does not read (it reads F32, "
            "F16, BF16, and the block types the gguf package decodes: Q8_0, Q4_0, Q4_K, ...)"
        )
    return ref


def values(ref: TensorRef, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """The tensor's values in `dtype` (None: as stored, a block type's bytes)."""
    try:
        return read_tensor(ref, dtype)
    except ModelLoadError as e:
        raise ModelLoadError(f"GGUF tensor {name}: {e}") from None


def own_codes(
    ref: TensorRef, name: str, rows: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Callable[[], Pool] | None:
    """How to read a block-quantised matrix as a kernels pool, its rows reordered by `rows` (the blocks of a row stay
    whole): a Q8_0 / Q4_0 one as its own codes; one of another type with a nearest tier (`NEAREST_TIER`) as its
    values, decoded by the `gguf` package, quantised to that tier's kind as `--quantize int8` / `int4` quantises a
    projection (`kernels.quantize`). None for any other tensor (float types, MXFP4, not a matrix)."""
    if len(ref.shape) != 2 or (ref.dtype not in CODE_TIERS and ref.dtype not in NEAREST_TIER):
        return None

    def read() -> Pool:
        blocks = values(ref, name, None)
        return matrix_pool(blocks if rows is None else rows(blocks), ref.dtype)

    def requantised() -> Pool:
        decoded = values(ref, name)
        return quantize((decoded if rows is None else rows(decoded))[None], TIER_KINDS[NEAREST_TIER[ref.dtype]])

    return read if ref.dtype in CODE_TIERS else requantised


def rotary_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo the converter's `permute` of a llama q or k projection [H * R, ...]: in each head it wrote row pairs
    (i, R/2 + i) side by side; the decoder rotates halves."""
    rows = w.shape[0] // heads
    return w.reshape(heads, rows // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def kv_b(f: GgufFile, config: Config, name: str) -> Dense:
    """DeepSeek's kv_b_proj [H * (N + V), L]: as written by older converters (`attn_kv_b`), or joined back from
    `attn_k_b` [H, L, N] and `attn_v_b` [H, V, L]."""
    layer = name.split(".")[2]
    whole_name = f"blk.{layer}.attn_kv_b.weight"
    whole = f.tensors.get(whole_name)
    if whole is not None:
        return Dense(whole.value_shape, lambda: values(whole, whole_name), own_codes(whole, whole_name))
    k_name, v_name = f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight"
    k, v = tensor(f, k_name), tensor(f, v_name)
    (heads, latent, nope), (_, v_dims, _) = k.value_shape, v.value_shape

    def read() -> torch.Tensor:
        joined = torch.cat([values(k, k_name).transpose(1, 2), values(v, v_name)], dim=1)  # [H, N + V, L]
        return joined.reshape(heads * (nope + v_dims), latent)

    return Dense((heads * (nope + v_dims), latent), read)


def gate_up_bias(f: GgufFile, config: Config, name: str) -> Dense:
    """gpt-oss's expert biases [E, 2I], gate and up interleaved, from `ffn_gate_exps.bias` and `ffn_up_exps.bias`."""
    layer = name.split(".")[2]
    gate_name, up_name = f"blk.{layer}.ffn_gate_exps.bias", f"blk.{layer}.ffn_up_exps.bias"
    gate, up = tensor(f, gate_name), tensor(f, up_name)
    n_experts, width = gate.value_shape

    def read() -> torch.Tensor:
        return torch.stack([values(gate, gate_name), values(up, up_name)], dim=-1).reshape(n_experts, 2 * width)

    return Dense((n_experts, 2 * width), read)


def down_bias(f: GgufFile, config: Config, name: str) -> Dense:
    ref_name = f"blk.{name.split('.')[2]}.ffn_down_exps.bias"
    ref = tensor(f, ref_name)
    return Dense(ref.value_shape, lambda: values(ref, ref_name))


def score_bias(f: GgufFile, config: Config, name: str) -> Dense:
    ref_name = f"blk.{name.split('.')[2]}.exp_probs_b.bias"
    ref = tensor(f, ref_name)
    return Dense(ref.value_shape, lambda: values(ref, ref_name))


# The decoder's tensors the converter does more than rename, by the last part of their names
SPECIAL: dict[str, Callable[[GgufFile, Config, str], Dense]] = {
    "kv_b_proj": kv_b,
    "gate_up_proj_bias": gate_up_bias,
    "down_proj_bias": down_bias,
    "e_score_correction_bias": score_bias,
}


def expert_handles(f: GgufFile, config: Config, moe_layers: list[int]) -> dict[int, list[ExpertHandle]]:
    """Every MoE layer's experts, each a slice of the layer's stacked tensors."""
    return {layer: layer_experts(f, config, layer) for layer in moe_layers}


def layer_experts(f: GgufFile, config: Config, layer: int) -> list[ExpertHandle]:
    fused = f"blk.{layer}.ffn_gate_up_exps.weight" in f.tensors
    ours = ("gate_up", "down") if fused else ("gate", "up", "down")
    stacked = {name: tensor(f, f"blk.{layer}.ffn_{name}_exps.weight") for name in ours}
    for name, ref in stacked.items():
        if not ref.shape or ref.shape[0] != config.n_experts:
            raise ModelLoadError(f"GGUF tensor blk.{layer}.ffn_{name}_exps.weight has shape {list(ref.value_shape)}, "
                                 f"the metadata implies {config.n_experts} experts")  # fmt: skip
    floats = all(ref.dtype in FLOAT_TYPES and ref.dtype in DTYPES for ref in stacked.values())
    layout = "gguf_pairs" if f.arch == "gpt-oss" else "linear" if floats else "gguf"
    return [ExpertHandle(layer, e, {name: slice_stacked(ref, e) for name, ref in stacked.items()}, layout)
            for e in range(config.n_experts)]  # fmt: skip
