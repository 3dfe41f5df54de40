"""Phi-MoE (`phimoe`: Phi-3.5-MoE-instruct): Mixtral's layout (experts `block_sparse_moe.experts.N.w1/w3/w2`, the
router `block_sparse_moe.gate`, the decoder's `mlp.*`; `sliding_window`, when set, on every layer) with LayerNorms
(weight and bias, eps `rms_norm_eps`) in place of every RMSNorm, `attention_bias` on q/k/v/o, a bias on the LM head
(`lm_head_bias`), and the "sparsemixer" router, which always picks two experts: the best, weighed by its softmax
probability among the experts whose logits lie within a relative `2 * router_jitter_noise` of it, then the best of
the rest, weighed the same way among the rest. No renormalisation; the router runs in the model's dtype, as the
reference runs it. `input_jitter_noise`, and the sampling sparsemixer does in training, are training-only.

Rope: default, or LongRoPE (`rope.longrope`) scaled by `short_mscale` below `original_max_position_embeddings` and
`long_mscale` from there on (not by `attention_factor`, which the reference ignores here). Once a sequence passes
that length each position keeps its own factors and mscale, short below it and long from it on, as a KV cache can
follow; transformers 5.24 instead turns the whole sequence by the short factors times `long_mscale` (it never uses
the long factors: its rotary recomputes the short ones each pass), so the two agree while a sequence stays below the
switch, as tested, and not past it.

Refused, as transformers does not compute them: top-k other than 2 (sparsemixer picks two whatever the config says),
other rope scalings (the reference would mix their frequencies with the mscales), a longrope without both mscales
(transformers refuses it), partial rotary."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Attention
from moelane.model.config import WINDOW, Config, key
from moelane.model.decoder import Decoder, sliding_windows
from moelane.model.family import W1_W3_W2, Family
from moelane.model.moe import MoeBlock
from moelane.model.rope import Rope
from moelane.model.routers import Gate, router_logits

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class PhimoeConfig(Config):
    rms_norm_eps: float = key(default=1e-5, low=0)
    max_position_embeddings: int = key(default=131072, low=1)
    rope_theta: float = 1e6
    n_experts: int = key("num_local_experts", default=16, low=0)
    top_k: int | None = key("num_experts_per_tok", default=2)
    expert_width: int | None = key("intermediate_size", default=None, low=1)
    router_jitter_noise: float = 0.01
    attention_bias: bool = False
    lm_head_bias: bool = False
    sliding_window: int | None = key(default=None, what=WINDOW)
    partial_rotary_factor: float = 1.0

    def check(self) -> None:
        if self.top_k != 2:
            raise ModelLoadError(f"phimoe routes with sparsemixer, which picks 2 experts: num_experts_per_tok "
                                 f"{self.top_k} is not supported")  # fmt: skip
        params = self.rope_params()
        if params["rope_type"] not in ("default", "longrope"):
            raise ModelLoadError(f"phimoe with rope scaling {params['rope_type']!r} is not supported (default, "
                                 "longrope)")  # fmt: skip
        mscales = [params.get(key) for key in ("short_mscale", "long_mscale")]
        if params["rope_type"] == "longrope" and not all(isinstance(m, int | float) for m in mscales):
            raise ModelLoadError(f"phimoe longrope needs short_mscale and long_mscale, got {mscales}")
        if self.partial_rotary_factor != 1.0:
            raise ModelLoadError("phimoe with partial_rotary_factor is not supported (its rotary turns whole heads)")
        if self.n_experts < 2:
            raise ModelLoadError("phimoe needs num_local_experts >= 2 (sparsemixer picks two)")
        sliding_windows(self.num_hidden_layers, self.sliding_window)

    def rope(self, dim: int | None = None) -> Rope:
        params = self.rope_params()
        built = Rope.build(params, dim or self.head_size, self.max_position_embeddings)
        if params["rope_type"] != "longrope":
            return built
        return dataclasses.replace(built, attention_factor=float(params["short_mscale"]),
                                   long_attention_factor=float(params["long_mscale"]))  # fmt: skip


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


@dataclass(frozen=True, slots=True)
class Sparsemixer:
    eps: float

    def __call__(self, x: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
        return sparsemixer(router_logits(x, gate, "model"), self.eps)


class Phimoe(Family[PhimoeConfig]):
    config_class = PhimoeConfig
    expert_names = W1_W3_W2

    def expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.block_sparse_moe.experts"

    def sanitize(self, weights: dict[str, T]) -> dict[str, T]:
        return {name.replace(".block_sparse_moe.", ".mlp."): w for name, w in weights.items()}

    def build(self, config: PhimoeConfig) -> Decoder:
        c, bias = config, config.attention_bias
        windows, router = sliding_windows(c.num_hidden_layers, c.sliding_window), Sparsemixer(c.router_jitter_noise)
        model = Decoder(
            c, lambda i: Attention.of(c, bias=bias, o_bias=bias, window=windows[i]), c.rope(),
            moe=lambda: MoeBlock(c.hidden_size, c.n_experts, router), norm=nn.LayerNorm,
        )  # fmt: skip
        if c.lm_head_bias:
            model.lm_head.bias = nn.Parameter(torch.zeros(c.vocab_size))
        return model


FAMILY = Phimoe()
