"""Phi-MoE (`phimoe`: Phi-3.5-MoE-instruct): Mixtral's layout (experts `block_sparse_moe.experts.N.w1/w3/w2`, the
router `block_sparse_moe.gate`, renamed to `mlp.*` on load; `sliding_window`, when set, on every layer) with
LayerNorms (weight and bias, eps `rms_norm_eps`) in place of every RMSNorm, `attention_bias` on q/k/v/o, a bias on
the LM head (`lm_head_bias`), and the "sparsemixer" router, which always picks two experts: the best, weighed by its
softmax probability among the experts whose logits lie within a relative `2 * router_jitter_noise` of it, then the
best of the rest, weighed the same way among the rest. No renormalisation; the router runs in the model's dtype, as
the reference runs it. `input_jitter_noise`, and the sampling sparsemixer does in training, are training-only.

Rope: default, or LongRoPE (`layers.longrope`) scaled by `short_mscale` below `original_max_position_embeddings` and
`long_mscale` from there on (not by `attention_factor`, which the reference ignores here). Once a sequence passes
that length each position keeps its own factors and mscale, short below it and long from it on, as a KV cache can
follow; transformers 5.24 instead turns the whole sequence by the short factors times `long_mscale` (it never uses
the long factors: its rotary recomputes the short ones each pass), so the two agree while a sequence stays below the
switch, as tested, and not past it.

`settle` (which `load` calls first) fills in transformers' defaults and refuses what it does not compute: top-k other
than 2 (sparsemixer picks two whatever the config says), other rope scalings (the reference would mix their
frequencies with the mscales), a longrope without both mscales (transformers refuses it), partial rotary."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, Routing, attention_heads, sliding_windows
from moelane.model.layers import Rope, linear, rope_parameters
from moelane.model.mixtral import EXPERT_NAMES, expert_prefix, sanitize
from moelane.model.moe import run_experts
from moelane.model.provider import ExpertProvider

__all__ = ["EXPERT_NAMES", "build", "expert_prefix", "expert_width", "n_experts", "sanitize", "settle"]
DEFAULTS = dict(num_local_experts=16, num_experts_per_tok=2, rms_norm_eps=1e-5, router_jitter_noise=0.01,
                attention_bias=False, lm_head_bias=False, tie_word_embeddings=False,
                max_position_embeddings=131072)  # transformers' defaults  # fmt: skip


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for keys it leaves out; a ModelLoadError for what it does not compute."""
    out = {**config, **{key: value for key, value in DEFAULTS.items() if config.get(key) is None}}
    if out["num_experts_per_tok"] != 2:
        raise ModelLoadError(f"phimoe routes with sparsemixer, which picks 2 experts: num_experts_per_tok "
                             f"{out['num_experts_per_tok']} is not supported")  # fmt: skip
    params = rope_parameters(out, 1e6)
    if params["rope_type"] not in ("default", "longrope"):
        raise ModelLoadError(f"phimoe with rope scaling {params['rope_type']!r} is not supported (default, longrope)")
    mscales = [params.get(key) for key in ("short_mscale", "long_mscale")]
    if params["rope_type"] == "longrope" and not all(isinstance(m, (int, float)) for m in mscales):
        raise ModelLoadError(f"phimoe longrope needs short_mscale and long_mscale, got {mscales}")
    if out.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("phimoe with partial_rotary_factor is not supported (its rotary turns whole heads)")
    return out


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparsemixer's top-2 at inference, logits [T, E] -> (weights, ids) [T, 2]. Twice: the best remaining expert,
    weighed by its softmax probability among the remaining experts whose logit is within a relative `2 * eps` of
    the best (`(best - logit) / max(|logit|, best)`); then that expert is taken out."""
    weights, ids, rest = [], [], logits
    for _ in range(2):
        best, top = rest.max(dim=-1, keepdim=True)  # [T, 1]
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps  # (measured on the logits themselves)
        probs = torch.softmax(rest.masked_fill(far, float("-inf")), dim=-1)  # in the logits' dtype, as the reference
        weights.append(probs.gather(-1, top))
        ids.append(top)
        rest = rest.scatter(-1, top, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class PhimoeMoe(nn.Module):
    def __init__(self, hidden: int, n_experts: int, eps: float) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.eps = eps

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sparsemixer(linear(x, self.gate.weight), self.eps)

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        return run_experts(x, layer, ids, weights, provider)


def rope(config: dict[str, Any], head_dim: int) -> Rope:
    params = rope_parameters(config, 1e6)  # (transformers' default theta for phimoe)
    built = Rope.build(params, head_dim, config["max_position_embeddings"])
    if params["rope_type"] != "longrope":
        return built
    return dataclasses.replace(built, attention_factor=float(params["short_mscale"]),
                               long_attention_factor=float(params["long_mscale"]))  # fmt: skip


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps, bias = config["hidden_size"], config["rms_norm_eps"], bool(config["attention_bias"])
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers = config["num_hidden_layers"]
    windows = sliding_windows(config, flagged=False)
    if n_experts(config) < 2:
        raise ModelLoadError("phimoe needs num_local_experts >= 2 (sparsemixer picks two)")

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, bias, eps=eps, o_bias=bias, window=windows[i])

    def make_mlp(i: int) -> nn.Module:
        return PhimoeMoe(hidden, n_experts(config), float(config["router_jitter_noise"]))

    model = Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp, rope(config, head_dim),
        bool(config["tie_word_embeddings"]), list(range(n_layers)), (n_kv, head_dim, head_dim), nn.LayerNorm,
    )  # fmt: skip
    if config["lm_head_bias"]:
        model.lm_head.bias = nn.Parameter(torch.zeros(config["vocab_size"]))
    return model


def n_experts(config: dict[str, Any]) -> int:
    return int(config["num_local_experts"])


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
