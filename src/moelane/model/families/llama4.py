"""Llama 4 (`llama4`: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E, text only; `llama4_text`, read by this module
too: the same text model as transformers' Llama4ForCausalLM saves it). GQA in two kinds of layers (`no_rope_layers`:
1 rotates, 0 is NoPE; by default every fourth layer is NoPE). Rope layers rotate interleaved pairs in fp32 (the
reference's complex rotary; Llama 3.1 scaling where the config says), then L2-normalise q and k (`use_qk_norm`: an
RMSNorm without a weight), and attend only within their chunk of `attention_chunk_size` positions (`layer_types`
"chunked_attention": `Window(chunked=True)`). NoPE layers attend to every earlier position, their queries scaled by a
temperature that grows with the position (`attn_temperature_tuning`: `1 + attn_scale * log1p(floor((p + 1) /
floor_scale))`). MoE every `interleave_moe_layer_step`-th layer (or the layers `moe_layers` lists): a router whose
top-k logits pass a sigmoid, the score scaling the expert's input rather than its output, plus a shared expert as wide
as the experts; dense layers are `intermediate_size_mlp` wide.

Experts are stored fused, `feed_forward.experts.gate_up_proj` [E, H, 2I] (gate then up columns) and `down_proj`
[E, I, H]: layout "transposed" (`checkpoint.fused_experts`). The releases (`model_type` "llama4") nest the text
model's config under `text_config`, read with the release's other keys (its `quantization_config`, `dtype`), and its
weights under `language_model.`, which `sanitize` drops (`feed_forward` becomes the decoder's `mlp`); the vision
tower and projector are skipped (`ignored`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention, Batch, Window, attend_streams
from moelane.model.checkpoint import ExpertHandle, TensorRef, fused_experts
from moelane.model.config import Config, key
from moelane.model.decoder import Decoder
from moelane.model.family import Family
from moelane.model.layers import MLP, linear, pointwise
from moelane.model.moe import MoeBlock, Names
from moelane.model.rope import Fp32Rope, rotate_pairs
from moelane.model.routers import Gate, router_logits

T = TypeVar("T")
RELEASE = "language_model."  # the releases' prefix of the text model's tensors


@dataclass(frozen=True, slots=True, kw_only=True)
class Llama4Config(Config):
    head_dim: int | None = key(default=128, low=1)
    num_key_value_heads: int | None = key(default=8, low=1)
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=131072, low=1)
    rope_theta: float = 500000.0
    n_experts: int = key("num_local_experts", default=16, low=0)
    top_k: int | None = key("num_experts_per_tok", default=1)
    expert_width: int | None = key("intermediate_size", default=8192, low=1)
    dense_width: int | None = key("intermediate_size_mlp", default=16384, low=1)
    attention_bias: bool = False
    interleave_moe_layer_step: int = key(default=1, low=1)
    moe_layer_list: list[int] | None = key("moe_layers", default=None)
    use_qk_norm: bool = True
    no_rope_layer_interval: int = key(default=4, low=1)
    no_rope_layers: list[int] | None = None
    attention_chunk_size: int | None = key(default=8192, keep_null=True, low=1)  # null: no chunks
    layer_types: list[str] | None = None
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    @classmethod
    def prepare(cls, d: Mapping[str, Any]) -> Mapping[str, Any]:
        """A release's `text_config`, the rest of its config underneath."""
        text = d.get("text_config")
        if not isinstance(text, dict):
            return d
        outer = {name: value for name, value in d.items() if name not in ("text_config", "vision_config")}
        return {**outer, **text, "model_type": d["model_type"]}

    def check(self) -> None:
        self.windows()
        if self.moe_layers() and self.n_experts < 1:
            raise ModelLoadError("llama4 needs num_local_experts >= 1 for its MoE layers")

    def rotates(self) -> list[bool]:
        """Per layer, whether it rotates (else NoPE)."""
        n_layers, rotates = self.num_hidden_layers, self.no_rope_layers
        if not rotates:
            rotates = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n_layers)]
        if len(rotates) < n_layers:
            raise ModelLoadError(f"llama4 needs no_rope_layers for each of its {n_layers} layers, got {len(rotates)}")
        return [bool(r) for r in rotates[:n_layers]]

    def windows(self) -> list[Window | None]:
        """Per layer, its chunks (None: full attention), as transformers reads the config."""
        n_layers, chunk = self.num_hidden_layers, self.attention_chunk_size
        types = self.layer_types or [
            "chunked_attention" if rotate and chunk is not None else "full_attention" for rotate in self.rotates()
        ]
        if len(types) != n_layers or not set(types) <= {"full_attention", "chunked_attention"}:
            raise ModelLoadError(f"llama4 needs layer_types, one per layer ({n_layers}), full_attention or "
                                 f"chunked_attention, got {types}")  # fmt: skip
        if chunk is None and "chunked_attention" in types:
            raise ModelLoadError("llama4 chunked_attention layers need an attention_chunk_size")
        chunked = None if chunk is None else Window(chunk, chunked=True)
        return [chunked if t == "chunked_attention" else None for t in types]

    def moe_layers(self) -> list[int]:
        n_layers, step, moe = self.num_hidden_layers, self.interleave_moe_layer_step, self.moe_layer_list
        return [i for i in range(n_layers) if i in set(range(step - 1, n_layers, step) if moe is None else moe)]


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x scaled to unit root mean square over its last dim, in fp32 then rounded (an RMSNorm without a weight)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(Attention):
    """GQA of either kind of layer: a rope layer (interleaved pairs, then q/k `l2_norm` where `use_qk_norm`) or a
    NoPE layer (queries scaled by the temperature of their position where `attn_temperature_tuning`)."""

    def __init__(self, config: Llama4Config, rotates: bool, window: Window | None) -> None:
        bias = config.attention_bias
        super().__init__(config.hidden_size, config.num_attention_heads, config.n_kv_heads, config.head_size, bias,
                         o_bias=bias, window=window)  # fmt: skip
        self.rotates = rotates
        self.l2_eps = config.rms_norm_eps if rotates and config.use_qk_norm else None
        tuning = not rotates and config.attn_temperature_tuning
        self.tuning = (config.floor_scale, config.attn_scale) if tuning else None

    def forward(
        self, x: torch.Tensor, layer: int, batch: Batch, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project(x)
        q, k = q.view(n, self.n_heads, self.head_dim), k.view(n, self.n_kv_heads, self.head_dim)
        v = v.view(n, self.n_kv_heads, self.head_dim)
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


@dataclass(frozen=True, slots=True)
class TopKSigmoid:
    """The top k router logits, each through a sigmoid in fp32 -> (scores, ids) [T, K]."""

    k: int

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(router_logits(x, gate, "model"), self.k, dim=-1)
        return pointwise(torch.sigmoid, top.float()), ids


class Llama4(Family[Llama4Config]):
    config_class = Llama4Config

    def expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.feed_forward.experts"

    def find_experts(
        self, refs: dict[str, TensorRef], prefix: str, n_experts: int, fp8_block: tuple[int, int] | None
    ) -> list[ExpertHandle] | None:
        """The layer's fused experts, under the text model's names or the release's (`language_model.`)."""
        if f"{prefix}.gate_up_proj" not in refs and f"{RELEASE}{prefix}.gate_up_proj" in refs:
            prefix = RELEASE + prefix
        return fused_experts(refs, prefix, n_experts)

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        return {name.removeprefix(RELEASE).replace(".feed_forward.", ".mlp."): w for name, w in weights.items()}

    def ignored(self, config: Llama4Config, name: str) -> bool:
        return name.startswith(("vision_model.", "multi_modal_projector."))  # the release's image side

    def build(self, config: Llama4Config) -> Decoder:
        c, rotates, windows = config, config.rotates(), config.windows()
        names = Names(gate="router", shared="shared_expert")

        def moe() -> MoeBlock:
            shared = MLP(c.hidden_size, c.moe_width)
            return MoeBlock(c.hidden_size, c.n_experts, TopKSigmoid(c.k), names=names, shared=shared, scale_inputs=True)

        rope = Fp32Rope.build(c.rope_params(), c.head_size, c.max_position_embeddings)
        return Decoder(c, lambda i: Llama4Attention(c, rotates[i], windows[i]), rope, moe=moe)


FAMILY = Llama4()
