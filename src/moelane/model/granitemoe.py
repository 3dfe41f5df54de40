"""IBM Granite MoE (`granitemoe`: granite-3.0-1b-a400m, granite-3.0-3b-a800m, granite-3.1-1b-a400m,
granite-3.1-3b-a800m, base and instruct): Llama-style GQA whose softmax scale is `attention_multiplier` instead of
1/sqrt(head_dim), and three multipliers the shared decoder does not have (`GraniteDecoder`): the embeddings times
`embedding_multiplier`, each block's output times `residual_multiplier` before it joins the residual stream, the
logits divided by `logits_scaling`. Every layer is MoE: the router (`router.layer`, its logits taken to fp32) picks
the top k logits and softmaxes over those k alone (`moe.topk_softmax`); the experts are SwiGLU, stored stacked:
`block_sparse_moe.input_linear.weight` [E, 2I, H] (gate rows, then up rows) and `output_linear.weight` [E, H, I],
each expert read as its slice of them (`find_experts`).

`granitemoeshared` is this plus a shared MLP beside the experts (`build_granite`'s `shared_width`). `settle` fills in
transformers' defaults for the keys a config leaves out: every multiplier 1, so a softmax scale of 1 too.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, cast

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention, Batch
from moelane.model.checkpoint import ExpertHandle, TensorRef, renamed, stacked_experts
from moelane.model.decoder import Decoder, DecoderLayer, Routing, attention_heads
from moelane.model.layers import Rope, linear, rope_parameters
from moelane.model.moe import expert_mlp, run_experts, topk_softmax
from moelane.model.provider import ExpertProvider

EXPERT_NAMES = {"gate_up": "input_linear.weight", "down": "output_linear.weight"}
DEFAULTS = dict(num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, attention_bias=False,
                tie_word_embeddings=False, max_position_embeddings=2048, embedding_multiplier=1.0,
                attention_multiplier=1.0, residual_multiplier=1.0,
                logits_scaling=1.0)  # transformers' defaults  # fmt: skip
T = TypeVar("T")
RENAMES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"^(model\.layers\.\d+)\.shared_mlp\."), r"\1.mlp.shared_mlp."),  # (granitemoeshared's)
]


def expert_prefix(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe"


def find_experts(refs: dict[str, TensorRef], prefix: str, n_experts: int) -> list[ExpertHandle] | None:
    return stacked_experts(refs, prefix, EXPERT_NAMES, n_experts)


def sanitize(weights: dict[str, T]) -> dict[str, T]:
    """Checkpoint names -> ours (values untouched): the MoE block is `mlp`, a shared MLP inside it."""
    return renamed(weights, RENAMES)


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for the keys it leaves out."""
    out = {**config, **{key: value for key, value in DEFAULTS.items() if config.get(key) is None}}
    if not out["logits_scaling"]:
        raise ModelLoadError(f"{config['model_type']} needs logits_scaling != 0 (the logits are divided by it)")
    return out


class Router(nn.Module):
    def __init__(self, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, n_experts, bias=False)  # (the checkpoint's name: `router.layer.weight`)


class FusedMlp(nn.Module):
    """A SwiGLU MLP whose gate and up projections are one matrix (`input_linear`, gate rows first), as Granite stores
    its shared MLP (and, stacked, its experts)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * width, bias=False)
        self.output_linear = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return expert_mlp(x, self.input_linear.weight, self.output_linear.weight)


class GraniteMoe(nn.Module):
    """Routed experts (the top k router logits softmaxed over those k weigh them), plus a shared MLP when
    `shared_width`."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, shared_width: int) -> None:
        super().__init__()
        self.router = Router(hidden, n_experts)
        self.shared_mlp = FusedMlp(hidden, shared_width) if shared_width else None
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = topk_softmax(linear(x, self.router.layer.weight).float(), self.top_k)
        return weights.to(x.dtype), ids  # (rounded to the model's dtype, as the reference's router gives them)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        out = run_experts(x, layer, ids, weights, provider)
        return out if self.shared_mlp is None else out + self.shared_mlp(x)


class GraniteDecoder(Decoder):
    """The shared decoder with Granite's multipliers on the embeddings, on each block's output and on the logits,
    applied in the model's dtype as the reference applies them."""

    def __init__(self, *args: Any, embedding: float, residual: float, logits: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.embedding_multiplier, self.residual_multiplier, self.logits_scaling = embedding, residual, logits

    def forward(self, tokens: torch.Tensor, batch: Batch, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        x = self.model.embed_tokens(tokens) * self.embedding_multiplier
        rope, scale = self.rope.cos_sin(batch.positions, x.dtype), self.residual_multiplier
        for i, layer in enumerate(cast(list[DecoderLayer], self.model.layers)):
            x = x + layer.self_attn(layer.input_layernorm(x), i, batch, rope) * scale
            x = x + layer.mlp(layer.post_attention_layernorm(x), i, provider, routing) * scale
        return cast(torch.Tensor, self.model.norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (linear(hidden, self.lm_head.weight) / self.logits_scaling).float()


def build(config: dict[str, Any]) -> Decoder:
    return build_granite(config, 0)


def build_granite(config: dict[str, Any], shared_width: int) -> Decoder:
    """A Granite MoE decoder, with a shared MLP of `shared_width` in every layer (0: none)."""
    hidden, eps, bias = config["hidden_size"], config["rms_norm_eps"], bool(config["attention_bias"])
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    if n_experts(config) < 1:
        raise ModelLoadError(f"{config['model_type']} needs num_local_experts >= 1 (every layer is MoE)")
    scale = float(config["attention_multiplier"])

    def make_attention(i: int) -> nn.Module:
        attention = Attention(hidden, n_heads, n_kv, head_dim, bias, eps=eps, o_bias=bias)
        attention.scale = scale  # (in place of 1/sqrt(head_dim))
        return attention

    def make_mlp(i: int) -> nn.Module:
        return GraniteMoe(hidden, n_experts(config), top_k, shared_width)

    rope = Rope.build(rope_parameters(config), head_dim, config["max_position_embeddings"])
    return GraniteDecoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope,
        bool(config["tie_word_embeddings"]), list(range(n_layers)), (n_kv, head_dim, head_dim),
        embedding=float(config["embedding_multiplier"]), residual=float(config["residual_multiplier"]),
        logits=float(config["logits_scaling"]),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config["num_local_experts"])


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
