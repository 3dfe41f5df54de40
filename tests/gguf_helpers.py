"""GGUF files for tests, written with the `gguf` package's writer from a saved Hugging Face model folder the way
llama.cpp's converter (convert_hf_to_gguf.py) writes them: its metadata keys, its tensor names (the converter's own
table, `gguf.get_tensor_name_map`), experts stacked [E, rows, cols], and the layout changes it makes (Llama's q/k rows
permuted for rope over pairs, DeepSeek's kv_b split into k_b and v_b, gpt-oss's gate/up split and transposed).

2-D weights are written at the asked type (F32, Q8_0, Q4_0, ...: quantised by `gguf.quants.quantize`, or, for the
K-quants the package cannot quantise, as random blocks with small scales); routers, norms, biases and 1-D tensors stay
F32, as the converter keeps them, and so do rows the type's blocks do not divide.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

ARCHS = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",
    "olmoe": "olmoe",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "glm4_moe": "glm4moe",
    "gpt_oss": "gpt-oss",
    "llama": "llama",
    "qwen3": "qwen3",
}
Tensors = dict[str, np.ndarray]


def write_gguf(folder: Path, out: Path, qtype: str = "F32", *, roundtrip: bool = False, split_tensors: int = 0,
               fuse_gate_up: bool = False, seed: int = 0) -> Path:  # fmt: skip
    """`folder` (a `random_model`) as a GGUF at `out` with 2-D weights at `qtype`. `roundtrip`: write F32 tensors
    holding the values the `qtype` file decodes to (the reference of a quantised file). `split_tensors`: split into
    files of that many tensors each (`-00001-of-0000N.gguf`). `fuse_gate_up`: the experts' gate and up stacked in
    one `ffn_gate_up_exps` (the converter's `--fuse-gate-up-exps`)."""
    config = json.loads((folder / "config.json").read_text())
    arch = ARCHS[config["model_type"]]
    tensors = converted(config, load_file(folder / "model.safetensors"), arch)
    if fuse_gate_up:
        tensors = fused_gate_up(tensors)
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_tensors)
    write_metadata(writer, config, arch)
    write_vocab(writer, folder, config["vocab_size"])
    rng = np.random.default_rng(seed)
    for name, data in tensors.items():
        kind = tensor_type(name, data, Q[qtype])
        raw = encode(data, kind, rng)
        if roundtrip and kind not in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.dequantize(raw, kind).astype(np.float32), raw_dtype=Q.F32)
        else:
            writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out if not split_tensors else first_part(out)


def fused_gate_up(tensors: Tensors) -> Tensors:
    out = {}
    for name, data in tensors.items():
        if ".ffn_gate_exps.weight" in name:
            up = tensors[name.replace("gate_exps", "up_exps")]
            out[name.replace("gate_exps", "gate_up_exps")] = np.concatenate([data, up], axis=1)
        elif ".ffn_up_exps.weight" not in name:
            out[name] = data
    return out


def first_part(out: Path) -> Path:
    return out.with_name(f"{out.stem}-00001-of-{len(list(out.parent.glob(out.stem + '-*-of-*.gguf'))):05d}.gguf")


def tensor_type(name: str, data: np.ndarray, qtype: Q) -> Q:
    """What the converter writes a tensor as: F32 for 1-D tensors, norms, biases and routers; else `qtype` where its
    blocks divide the rows."""
    keep = data.ndim <= 1 or name.endswith(("_norm.weight", ".bias")) or ".ffn_gate_inp" in name
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return Q.F32 if keep or data.shape[-1] % block else qtype


def encode(data: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    if kind in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16):
        return gguf.quants.quantize(data.astype(np.float32), kind)
    return random_blocks(data.shape, kind, rng)


# Where the fp16 scales of a K-quant block are (byte offsets, after the type's own layout in ggml-common.h)
K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(shape: tuple[int, ...], kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant (the `gguf` package decodes them but cannot quantise), their fp16 scales set to
    small numbers so the weights stay the size of a model's."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in K_SCALES[kind]:
        raw[:, at : at + 2] = rng.uniform(0.0005, 0.002, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def converted(config: dict[str, Any], weights: dict[str, torch.Tensor], arch: str) -> Tensors:
    """The tensors of a GGUF, by llama.cpp's names, in its layouts (numpy, float32)."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch_member(arch)], config["num_hidden_layers"])
    out: Tensors = {}
    for hf_name, data in hf_tensors(config, weights, arch):
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".weight", ".bias"))  # fmt: skip
        assert name is not None, hf_name
        out[name + (".weight" if name.endswith("attn_sinks") else "")] = data.float().numpy()  # (as it names them)
    return out


def arch_member(arch: str) -> str:
    return next(member.name for member, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


Named = Iterator[tuple[str, torch.Tensor]]


def hf_tensors(config: dict[str, Any], weights: dict[str, torch.Tensor], arch: str) -> Named:
    """The checkpoint's tensors as the converter hands them to its name table: experts stacked per layer, and the
    architecture's own changes made."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, data in weights.items():
        if ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():
            prefix, rest = name.split(".experts.")
            index, kind = rest.split(".", 1)
            experts.setdefault(f"{prefix}.experts.{kind}", {})[int(index)] = data
            continue
        yield from CHANGES.get(arch, unchanged)(config, name, data)
    for name, by_index in experts.items():
        if ".block_sparse_moe." in name:  # (Mixtral's, under the name the converter gives them)
            name = "layers.{}.feed_forward.experts.{}.weight".format(*name.split(".")[2::3])
        yield name, torch.stack([by_index[i] for i in sorted(by_index)])


def unchanged(config: dict[str, Any], name: str, data: torch.Tensor) -> Named:
    yield name, data


def llama(config: dict[str, Any], name: str, data: torch.Tensor) -> Named:
    """The converter's `permute` of q and k: each head's rotary halves interleaved, for ggml's rope over pairs."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    kind = name.split(".")[-2]
    if kind in heads:
        n = heads[kind]
        data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
    yield name, data


def deepseek(config: dict[str, Any], name: str, data: torch.Tensor) -> Named:
    """kv_b_proj split per head into k_b (transposed) and v_b, for MLA's absorbed attention."""
    if not name.endswith("kv_b_proj.weight"):
        yield name, data
        return
    heads, nope, v_dims = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    k_b, v_b = data.view(heads, nope + v_dims, -1).split([nope, v_dims], dim=1)
    yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()
    yield name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous()


def gpt_oss(config: dict[str, Any], name: str, data: torch.Tensor) -> Named:
    """Fused experts ([E, H, 2I] gate/up interleaved, [E, I, H] down) split into gate and up and transposed to
    F.linear's layout; their biases split likewise; the sinks named as weights."""
    if name.endswith("gate_up_proj"):
        data = data.transpose(-1, -2)
        yield name.replace("gate_up_proj", "gate_proj.weight"), data[:, ::2]
        yield name.replace("gate_up_proj", "up_proj.weight"), data[:, 1::2]
    elif name.endswith("gate_up_proj_bias"):
        yield name.replace("gate_up_proj_bias", "gate_proj.bias"), data[..., ::2]
        yield name.replace("gate_up_proj_bias", "up_proj.bias"), data[..., 1::2]
    elif name.endswith("down_proj"):
        yield name.replace("down_proj", "down_proj.weight"), data.transpose(-1, -2)
    elif name.endswith("down_proj_bias"):
        yield name.replace("down_proj_bias", "down_proj.bias"), data
    else:
        yield name, data


CHANGES: dict[str, Callable[[dict[str, Any], str, torch.Tensor], Named]] = {
    "llama": llama, "deepseek2": deepseek, "gpt-oss": gpt_oss}  # fmt: skip


def write_metadata(w: gguf.GGUFWriter, c: dict[str, Any], arch: str) -> None:
    """The converter's `set_gguf_parameters`: the keys every architecture gets, then its own."""
    rope = c.get("rope_parameters") or {}
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1 if arch == "deepseek2" else c["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if n_experts := c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts"):
        w.add_expert_count(n_experts)
        w.add_expert_used_count(c["num_experts_per_tok"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None:
                getattr(w, f"add_rope_scaling_yarn_{key}")(rope[key])
    if c.get("head_dim") and arch != "deepseek2":
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    EXTRA.get(arch, lambda w, c: None)(w, c)


def qwen_moe(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def llama_extra(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_vocab_size(c["vocab_size"])
    w.add_rope_dimension_count(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def deepseek_extra(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(c["kv_lora_rank"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if c["model_type"] == "deepseek_v3":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])


def glm_extra(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    factor = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
    w.add_rope_dimension_count(int(head_dim * factor))
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])


def gpt_oss_extra(w: gguf.GGUFWriter, c: dict[str, Any]) -> None:
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])


EXTRA: dict[str, Callable[[gguf.GGUFWriter, dict[str, Any]], None]] = {
    "qwen3moe": qwen_moe, "qwen2moe": qwen_moe, "llama": llama_extra, "deepseek2": deepseek_extra,
    "glm4moe": glm_extra, "gpt-oss": gpt_oss_extra}  # fmt: skip


def write_vocab(w: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The converter's `_set_vocab_gpt2`: every id's token (the byte-level alphabet's text), its type, the merges,
    the special token ids and the chat template (`gguf.SpecialVocab`)."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in spec["model"]["vocab"].items()}
    added = {a["id"]: a for a in spec["added_tokens"]}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w, quiet=True)


def convert_with_llama_cpp(folder: Path, out: Path, tree: Path, outtype: str = "f32") -> Path:
    """`folder` converted by llama.cpp's own convert_hf_to_gguf.py from the llama.cpp tree `tree` (its gguf-py
    first on the path). The test tokenizer is GPT-2's byte-level BPE, which the converter knows by no hash: it is
    declared "gpt-2", and read as a gpt2 vocabulary where the converter would look for SentencePiece (Llama) or
    GLM's special tokens."""
    import subprocess
    import sys

    root = str(tree.resolve())
    shim = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{root!r}, {root + '/gguf-py'!r}]\n"
        "import conversion.base as base, conversion.glm as glm, conversion.llama as llama\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "llama.LlamaModel.set_vocab = glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()\n"
        f"sys.argv = [{root + '/convert_hf_to_gguf.py'!r}, {str(folder)!r}, '--outfile', {str(out)!r}, "
        f"'--outtype', {outtype!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", shim], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return out
