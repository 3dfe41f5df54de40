"""Llama 4 (`llama4`: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E, text only; `llama4_text`: the same text model
as transformers' Llama4ForCausalLM saves it). GQA in two kinds of layers (`no_rope_layers`: 1 rotates, 0 is NoPE;
by default every fourth layer is NoPE). Rope layers rotate interleaved pairs in fp32 (the reference's complex
rotary; Llama 3.1 scaling where the config says), then L2-normalise q and k (`use_qk_norm`: an RMSNorm without a
weight), and attend only within their chunk of `attention_chunk_size` positions (`layer_types` "chunked_attention":
`Window(chunked=True)`). NoPE layers attend to every earlier position, their queries scaled by a temperature that
grows with the position (`attn_temperature_tuning`: `1 + attn_scale * log1p(floor((p + 1) / floor_scale))`).
MoE every `interleave_moe_layer_step`-th layer (or the layers `moe_layers` lists): a router whose top-k logits pass a
sigmoid, the score scaling the expert's input rather than its output, plus a shared expert as wide as the experts;
dense layers are `intermediate_size_mlp` wide.

Experts are stored fused, `feed_forward.experts.gate_up_proj` [E, H, 2I] (gate then up columns) and `down_proj`
[E, I, H]: gpt-oss's "transposed" layout, found by its `find_experts`. The releases (`model_type` "llama4") nest the
text model's config under `text_config`, which `settle` lifts, and its weights under `language_model.`, which
`sanitize` drops (`feed_forward` becomes the decoder's `mlp`); the vision tower and projector are skipped
(`ignored`)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model import gpt_oss
from moelane.model.attention import Attention, Batch, Window, attend_streams
from moelane.model.checkpoint import ExpertHandle, TensorRef
from moelane.model.decoder import Decoder, DenseMlp, Routing, attention_heads
from moelane.model.deepseek_v2 import rotate_pairs
from moelane.model.ernie4_5_moe import Fp32Rope
from moelane.model.layers import MLP, linear, pointwise, rope_parameters
from moelane.model.moe import run_experts
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = gpt_oss.EXPERT_NAMES  # (stacked: `gate_up_proj`, `down_proj`)
RELEASE = "language_model."  # the releases' prefix of the text model's tensors
DEFAULTS = dict(head_dim=128, num_key_value_heads=8, intermediate_size=8192, intermediate_size_mlp=16384,
                max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1, use_qk_norm=True,
                no_rope_layer_interval=4, attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192,
                attn_scale=0.1)  # transformers' defaults for keys a config leaves out  # fmt: skip
T = TypeVar("T")


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.feed_forward.experts"


def find_experts(refs: dict[str, TensorRef], prefix: str, n_experts: int) -> list[ExpertHandle] | None:
    """The layer's fused experts, under the text model's names or the release's (`language_model.`)."""
    if f"{prefix}.gate_up_proj" not in refs and f"{RELEASE}{prefix}.gate_up_proj" in refs:
        prefix = RELEASE + prefix
    return gpt_oss.find_experts(refs, prefix, n_experts)


def sanitize(weights: dict[str, T]) -> dict[str, T]:
    """Checkpoint names -> ours (values untouched)."""
    return {name.removeprefix(RELEASE).replace(".feed_forward.", ".mlp."): w for name, w in weights.items()}


def ignored(config: dict[str, Any], name: str) -> bool:
    return name.startswith(("vision_model.", "multi_modal_projector."))  # the release's image side


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config (a release's `text_config`, the rest of it underneath: its `quantization_config`,
    `dtype`), with transformers' defaults for the keys it leaves out (only those: a null `attention_chunk_size`
    means no chunks)."""
    text = config.get("text_config")
    if isinstance(text, dict):
        outer = {key: value for key, value in config.items() if key not in ("text_config", "vision_config")}
        config = {**outer, **text, "model_type": config["model_type"]}
    return {**DEFAULTS, **config}


def layer_plan(config: dict[str, Any]) -> tuple[list[bool], list[Window | None], list[int]]:
    """As transformers reads the config: per layer, whether it rotates and its window (None: full attention); and
    the MoE layers. A ModelLoadError for lists that do not cover the layers, or chunks of no size."""
    n_layers, chunk = int(config["num_hidden_layers"]), config["attention_chunk_size"]
    interval, step = config["no_rope_layer_interval"], config["interleave_moe_layer_step"]
    rotates = config.get("no_rope_layers")
    if not rotates:
        whole_number(interval, "no_rope_layer_interval")
        rotates = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(rotates) < n_layers:
        raise ModelLoadError(f"llama4 needs no_rope_layers for each of its {n_layers} layers, got {len(rotates)}")
    if chunk is not None:
        whole_number(chunk, "attention_chunk_size")
    types = config.get("layer_types") or [
        "chunked_attention" if rotate and chunk is not None else "full_attention" for rotate in rotates[:n_layers]
    ]
    if len(types) != n_layers or not set(types) <= {"full_attention", "chunked_attention"}:
        raise ModelLoadError(f"llama4 needs layer_types, one per layer ({n_layers}), full_attention or "
                             f"chunked_attention, got {types}")  # fmt: skip
    if chunk is None and "chunked_attention" in types:
        raise ModelLoadError("llama4 chunked_attention layers need an attention_chunk_size")
    moe = config.get("moe_layers")
    if moe is None:
        whole_number(step, "interleave_moe_layer_step")
        moe = range(step - 1, n_layers, step)
    chunked = None if chunk is None else Window(chunk, chunked=True)
    windows = [chunked if t == "chunked_attention" else None for t in types]
    return [bool(r) for r in rotates[:n_layers]], windows, [i for i in range(n_layers) if i in set(moe)]


def whole_number(value: Any, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"llama4 {key} must be a whole number >= 1, got {value!r}")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x scaled to unit root mean square over its last dim, in fp32 then rounded (an RMSNorm without a weight)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(Attention):
    """GQA of either kind of layer: a rope layer (interleaved pairs, then q/k `l2_norm` where `use_qk_norm`) or a
    NoPE layer (queries scaled by the temperature of their position where `attn_temperature_tuning`)."""

    def __init__(self, config: dict[str, Any], rotates: bool, window: Window | None) -> None:
        n_heads, n_kv, head_dim = attention_heads(config)
        bias, eps = bool(config["attention_bias"]), float(config["rms_norm_eps"])
        super().__init__(config["hidden_size"], n_heads, n_kv, head_dim, bias, o_bias=bias, window=window)
        self.rotates = rotates
        self.l2_eps = eps if rotates and config["use_qk_norm"] else None
        tuning = not rotates and bool(config["attn_temperature_tuning"])
        self.tuning = (float(config["floor_scale"]), float(config["attn_scale"])) if tuning else None

    def forward(
        self, x: torch.Tensor, layer: int, batch: Batch, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q = linear(x, self.q_proj.weight, self.q_proj.bias).view(n, self.n_heads, self.head_dim)
        k = linear(x, self.k_proj.weight, self.k_proj.bias).view(n, self.n_kv_heads, self.head_dim)
        v = linear(x, self.v_proj.weight, self.v_proj.bias).view(n, self.n_kv_heads, self.head_dim)
        if self.rotates:
            q, k = self.rotate(q, k, *rope)
        elif self.tuning is not None:
            q = (q.float() * self.temperature(batch.positions)[:, None, None]).to(q.dtype)
        out = attend_streams(q, k, v, layer, batch, self.scale, self.window)
        return linear(out.reshape(n, -1), self.o_proj.weight, self.o_proj.bias)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        return (q, k) if self.l2_eps is None else (l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps))

    def temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """The NoPE layer's query scale at each position [N], fp32."""
        assert self.tuning is not None
        floor_scale, attn_scale = self.tuning
        steps = torch.floor((positions.float() + 1.0) / floor_scale)
        return pointwise(torch.log1p, steps) * attn_scale + 1.0


class Llama4Moe(nn.Module):
    """Routed experts, each fed its token's row times its sigmoid score, plus the shared expert."""

    def __init__(self, hidden: int, width: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.shared_expert = MLP(hidden, width)
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (scores fp32, ids) [T, K]: the top-k router logits, each through a sigmoid."""
        top, ids = torch.topk(linear(x, self.router.weight), self.top_k, dim=-1)
        return pointwise(torch.sigmoid, top.float()), ids

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        scores, ids = self.route(x)
        routing.append((ids, scores))
        inputs = x[:, None, :] * scores.to(x.dtype)[..., None]  # [T, K, H]: each pair's own input
        routed = run_experts(inputs, layer, ids, torch.ones_like(scores), provider)
        shared: torch.Tensor = self.shared_expert(x)
        return shared + routed


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    _, n_kv, head_dim = attention_heads(config)
    n_layers = config["num_hidden_layers"]
    rotates, windows, moe_layers = layer_plan(config)
    if moe_layers and n_experts(config) < 1:
        raise ModelLoadError("llama4 needs num_local_experts >= 1 for its MoE layers")

    def make_attention(i: int) -> nn.Module:
        return Llama4Attention(config, rotates[i], windows[i])

    def make_mlp(i: int) -> nn.Module:
        if i in moe_layers:
            return Llama4Moe(hidden, expert_width(config), n_experts(config), int(config["num_experts_per_tok"]))
        return DenseMlp(hidden, config["intermediate_size_mlp"])

    max_pos = config["max_position_embeddings"]
    rope = Fp32Rope.build(rope_parameters(config, default_theta=500000.0), head_dim, max_pos)
    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config["tie_word_embeddings"]), moe_layers, (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config["num_local_experts"])


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
