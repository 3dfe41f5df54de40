"""A GGUF's metadata as the config.json its family reads: llama.cpp's keys (`qwen3moe.expert_count`) under the
Hugging Face names (`num_experts`), so every family's typed config (`Config.from_dict`) checks a GGUF exactly as it
checks a folder.

What the metadata does not say is taken as llama.cpp computes the architecture, so that moelane runs the model
llama.cpp runs: Qwen3-MoE renormalises its top-k weights, Qwen2-MoE and OLMoE do not, and every layer of both Qwen
MoEs has experts; whether attention has biases or q/k norms, whether the head is tied, come from the tensors present
(docs/gguf.md#what-is-read-from-where).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moelane.errors import ModelLoadError
from moelane.model.gguf.file import GgufFile

Config = dict[str, Any]


class Keys:
    """One architecture's metadata: `get("expert_count")` reads `<arch>.expert_count`."""

    def __init__(self, f: GgufFile) -> None:
        self.file, self.arch = f, f.arch

    def get(self, name: str, default: Any = None) -> Any:
        value = self.file.metadata.get(f"{self.arch}.{name}")
        return default if value is None else value

    def need(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {self.arch}.{name} ({self.file.path.name})")
        return value

    def one(self, name: str, default: Any = None) -> Any:
        """A value that may be written per layer (a list): all layers must agree."""
        value = self.get(name, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ModelLoadError(f"GGUF metadata {self.arch}.{name} differs between layers ({value[:8]}...): "
                                     "moelane needs one value for every layer")  # fmt: skip
            return value[0]
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.file.tensors


def hf_config(f: GgufFile) -> Config:
    """The config.json a Hugging Face release of this GGUF's model would have (the keys the families read)."""
    if f.arch not in ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {f.arch!r} (general.architecture of {f.path.name}); "
                             f"supported: {', '.join(ARCHS)}")  # fmt: skip
    keys = Keys(f)
    return {**common(keys), **ARCHS[f.arch](keys)}


def common(k: Keys) -> Config:
    embedding = k.file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"GGUF file has no tensor token_embd.weight ({k.file.path.name})")
    return {
        "num_hidden_layers": k.need("block_count"),
        "hidden_size": k.need("embedding_length"),
        "num_attention_heads": k.one("attention.head_count"),
        "num_key_value_heads": k.one("attention.head_count_kv"),
        "head_dim": k.get("attention.key_length"),
        "max_position_embeddings": k.get("context_length"),
        "rms_norm_eps": k.get("attention.layer_norm_rms_epsilon"),
        "vocab_size": embedding.value_shape[0],
        "intermediate_size": k.one("feed_forward_length"),
        "tie_word_embeddings": not k.has("output.weight"),
        "rope_parameters": rope(k),
        "dtype": "bfloat16" if k.file.metadata.get("general.file_type") == BF16_FILE else None,
    }


BF16_FILE = 32  # llama.cpp's LLAMA_FTYPE_MOSTLY_BF16


def rope(k: Keys) -> Config:
    """rope_theta and scaling (`rope.rope_parameters`' names); llama.cpp's default theta where the file has none.
    Per-frequency factors (a `rope_freqs` tensor: Llama 3.1's scaling as llama.cpp writes it) are refused."""
    if k.has("rope_freqs.weight"):
        raise ModelLoadError("GGUF rope_freqs (per-frequency rope factors) are not supported yet")
    params: Config = {"rope_theta": float(k.get("rope.freq_base", 10000.0)), "rope_type": "default"}
    kind = k.get("rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        params.update(rope_type=kind, factor=float(k.need("rope.scaling.factor")))
    if kind == "yarn":
        optional = {"original_max_position_embeddings": "rope.scaling.original_context_length",
                    "beta_fast": "rope.scaling.yarn_beta_fast", "beta_slow": "rope.scaling.yarn_beta_slow",
                    "attention_factor": "rope.scaling.yarn_attn_factor"}  # fmt: skip
        params.update({name: k.get(key) for name, key in optional.items() if k.get(key) is not None})
    elif kind not in ("none", "linear"):
        raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r} ({k.arch}.rope.scaling.type)")
    return params


def moe(k: Keys, experts: str, width: str) -> Config:
    """The expert count, top-k and expert width under the names a family reads them."""
    return {experts: k.need("expert_count"), "num_experts_per_tok": k.need("expert_used_count"),
            width: k.one("expert_feed_forward_length", k.one("feed_forward_length"))}  # fmt: skip


def qwen3moe(k: Keys) -> Config:
    return {"model_type": "qwen3_moe", **moe(k, "num_experts", "moe_intermediate_size"),
            "norm_topk_prob": k.get("expert_weights_norm", True), "mlp_only_layers": [],
            "attention_bias": k.has("blk.0.attn_q.bias")}  # fmt: skip


def qwen2moe(k: Keys) -> Config:
    shared = k.get("expert_shared_feed_forward_length")
    return {"model_type": "qwen2_moe", **moe(k, "num_experts", "moe_intermediate_size"), "norm_topk_prob": False,
            "shared_expert_intermediate_size": shared, "mlp_only_layers": [],
            "qkv_bias": k.has("blk.0.attn_q.bias")}  # fmt: skip


def llama(k: Keys) -> Config:
    """Llama-architecture files: Mixtral where they have experts, else a dense Llama."""
    bias = k.has("blk.0.attn_q.bias")
    if k.get("expert_count", 0) == 0:
        return {"model_type": "llama", "attention_bias": bias}
    if bias:
        raise ModelLoadError("a llama-architecture GGUF with experts and attention biases is not a Mixtral")
    return {"model_type": "mixtral", **moe(k, "num_local_experts", "intermediate_size")}


def olmoe(k: Keys) -> Config:
    return {"model_type": "olmoe", **moe(k, "num_experts", "intermediate_size"), "norm_topk_prob": False,
            "attention_bias": k.has("blk.0.attn_q.bias"), "clip_qkv": k.get("attention.clamp_kqv")}  # fmt: skip


SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def deepseek2(k: Keys) -> Config:
    """DeepSeek-V2 (softmax router) or V3 (sigmoid router with a score bias; a file without `expert_gating_func` but
    with score biases is V3 too, converted from a config.json without `scoring_func`, where llama.cpp would take a
    softmax and add the bias). llama.cpp runs MLA as one key head;
    the decompressed heads are as many as the query heads. Yarn's `mscale_all_dim` comes back from the log multiplier
    llama.cpp's converter writes (0.1 of it), and `mscale` is taken equal to it, as the released models have them."""
    heads, rope_dims = k.one("attention.head_count"), k.need("rope.dimension_count")
    score_bias = any(name.endswith(".exp_probs_b.bias") for name in k.file.tensors)
    v3 = k.get("expert_gating_func", SIGMOID if score_bias else None) == SIGMOID
    n_group = k.get("expert_group_count", 1)
    d: Config = {
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        **moe(k, "n_routed_experts", "moe_intermediate_size"),
        "num_key_value_heads": heads,
        "head_dim": None,
        "q_lora_rank": k.get("attention.q_lora_rank"),
        "kv_lora_rank": k.need("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dims,
        "qk_nope_head_dim": k.get("attention.key_length_mla", k.get("attention.key_length")) - rope_dims,
        "v_head_dim": k.get("attention.value_length_mla", k.get("attention.value_length")),
        "n_shared_experts": k.get("expert_shared_count", 0) or None,
        "first_k_dense_replace": k.get("leading_dense_block_count", 0),
        "routed_scaling_factor": k.get("expert_weights_scale", 1.0),
        "norm_topk_prob": k.get("expert_weights_norm", False),
        "n_group": n_group,
        "topk_group": k.get("expert_group_used_count", 1),
    }
    if not v3:
        d["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    log_mul = k.get("rope.scaling.yarn_log_multiplier")
    if log_mul:
        d["rope_parameters"] = {**rope(k), "mscale_all_dim": log_mul / 0.1, "mscale": log_mul / 0.1}
    return d


def glm4moe(k: Keys) -> Config:
    """GLM-4.5: the file's block count includes its multi-token-prediction layers (`nextn_predict_layers`), which
    decoding skips."""
    head_dim = k.get("attention.key_length") or k.need("embedding_length") // k.one("attention.head_count")
    return {"model_type": "glm4_moe", **moe(k, "n_routed_experts", "moe_intermediate_size"),
            "num_hidden_layers": k.need("block_count") - k.get("nextn_predict_layers", 0),
            "n_shared_experts": k.get("expert_shared_count", 0) or None,
            "first_k_dense_replace": k.get("leading_dense_block_count", 0),
            "routed_scaling_factor": k.get("expert_weights_scale", 1.0),
            "norm_topk_prob": k.get("expert_weights_norm", False),
            "n_group": k.get("expert_group_count", 1), "topk_group": k.get("expert_group_used_count", 1),
            "use_qk_norm": k.has("blk.0.attn_q_norm.weight"), "attention_bias": k.has("blk.0.attn_q.bias"),
            "partial_rotary_factor": k.need("rope.dimension_count") / head_dim}  # fmt: skip


def gpt_oss(k: Keys) -> Config:
    """gpt-oss: even layers slide (as llama.cpp and transformers place them); yarn without the rounding of its
    correction range (`truncate: false`, as the released config.json says)."""
    rope_params = rope(k)
    if rope_params["rope_type"] == "yarn":
        rope_params["truncate"] = False
    return {"model_type": "gpt_oss", **moe(k, "num_local_experts", "intermediate_size"),
            "sliding_window": k.get("attention.sliding_window"), "rope_parameters": rope_params}  # fmt: skip


def qwen3(k: Keys) -> Config:
    return {"model_type": "qwen3", "attention_bias": k.has("blk.0.attn_q.bias")}


# llama.cpp's architecture names (general.architecture) -> their config.json
ARCHS: dict[str, Callable[[Keys], Config]] = {
    "qwen3moe": qwen3moe,
    "qwen2moe": qwen2moe,
    "llama": llama,
    "olmoe": olmoe,
    "deepseek2": deepseek2,
    "glm4moe": glm4moe,
    "gpt-oss": gpt_oss,
    "qwen3": qwen3,
}
