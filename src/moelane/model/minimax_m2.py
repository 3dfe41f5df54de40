"""MiniMax-M2 (`minimax_m2`: MiniMax-M2, M2.1, M2.5): GQA whose q/k RMSNorms run over the whole projection, every head
at once (`qk_norm_type` "per_layer", as OLMoE's), before the rotary embedding turns the first `rotary_dim` dims of each
head (Llama-style halves); every layer MoE, a sigmoid router whose top-k choice adds a learnt per-expert bias
(`e_score_correction_bias`) while the weights are the unbiased scores renormalised to sum 1; no shared expert.
Checkpoint names are Mixtral's (`block_sparse_moe.gate`, experts `w1/w3/w2`), renamed as Mixtral's are (`sanitize`).

The router computes in the model's dtype and only its sigmoid in fp32, as transformers computes it (vLLM and SGLang
keep it in fp32; the two agree in fp32). `settle` fills in transformers' defaults (a head of 128 dims, not hidden /
heads) and refuses the keys of MiniMax's own code that transformers 5.24 ignores (per-head q/k norms, no q/k norm,
another scoring function, no routing bias, shared experts, lightning-attention layers): a checkpoint that needs them
would not compute what it was trained to. The multi-token-prediction layers (`model.layers.{num_hidden_layers + i}`,
`num_mtp_modules`) are skipped, as transformers skips them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model import mixtral
from moelane.model.attention import Attention
from moelane.model.decoder import Decoder, Routing, attention_heads, config_get, past_last_layer
from moelane.model.layers import Rope, linear, pointwise, rope_parameters
from moelane.model.moe import biased_group_topk, run_experts
from moelane.model.provider import ExpertProvider

EXPERT_NAMES, expert_prefix, sanitize = mixtral.EXPERT_NAMES, mixtral.expert_prefix, mixtral.sanitize
ignored = past_last_layer  # the multi-token-prediction layers' tensors
DEFAULTS = dict(head_dim=128, intermediate_size=1536, num_local_experts=256, num_experts_per_tok=8, rms_norm_eps=1e-6,
                max_position_embeddings=196608, tie_word_embeddings=False)  # transformers' defaults  # fmt: skip


def settle(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults for keys it leaves out; a ModelLoadError for what transformers does not
    compute."""
    out = dict(config)
    out["num_local_experts"] = config_get(config, "num_local_experts", "num_experts", default=None)
    out.update({key: value for key, value in DEFAULTS.items() if out.get(key) is None})
    if out.get("use_qk_norm") is False or out.get("qk_norm_type", "per_layer") != "per_layer":
        raise ModelLoadError(f"minimax_m2 needs q/k norms over the whole projection (use_qk_norm, qk_norm_type "
                             f"'per_layer'), got {out.get('use_qk_norm')}, {out.get('qk_norm_type')!r}")  # fmt: skip
    if out.get("scoring_func", "sigmoid") != "sigmoid" or out.get("use_routing_bias") is False:
        raise ModelLoadError("minimax_m2 routes by sigmoid scores with a routing bias (scoring_func 'sigmoid', "
                             "use_routing_bias)")  # fmt: skip
    if out.get("shared_intermediate_size") or any(kind != 1 for kind in out.get("attn_type_list") or []):
        raise ModelLoadError("minimax_m2 with shared experts (shared_intermediate_size) or lightning-attention "
                             "layers (attn_type_list 0) is not supported")  # fmt: skip
    return out


class MiniMaxMoe(nn.Module):
    """Routed experts chosen by sigmoid scores plus a per-expert bias, weighed by the scores renormalised. The router
    `gate` and the bias under the checkpoints' names (after `sanitize`): `mlp.gate.weight`,
    `mlp.e_score_correction_bias`."""

    def __init__(self, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.e_score_correction_bias = nn.Buffer(torch.zeros(n_experts))
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = pointwise(torch.sigmoid, linear(x, self.gate.weight).float())  # [T, E]
        weights, ids = biased_group_topk(scores, self.e_score_correction_bias, self.top_k, 1, 1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        weights, ids = self.route(x)
        routing.append((ids, weights))
        return run_experts(x, layer, ids, weights, provider)


def rotary_dims(config: dict[str, Any], params: dict[str, Any], head_dim: int) -> int:
    """The dims of each head that rotate: `partial_rotary_factor` (of the rope parameters, else the top level), else
    the released configs' `rotary_dim`, else the whole head; as transformers reads them."""
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None:
        factor = config["rotary_dim"] / head_dim if config.get("rotary_dim") is not None else 1.0
    rotary = int(head_dim * float(factor))
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ModelLoadError(f"minimax_m2 rotates {rotary} dims of a head's {head_dim} (rotary_dim, "
                             "partial_rotary_factor); they must be an even number from 2 to the head's")  # fmt: skip
    return rotary


def build(config: dict[str, Any]) -> Decoder:
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    n_heads, n_kv, head_dim = attention_heads(config)
    n_layers, top_k = config["num_hidden_layers"], int(config["num_experts_per_tok"])
    if n_experts(config) < 1:
        raise ModelLoadError("minimax_m2 needs num_local_experts >= 1")
    params = rope_parameters(config, default_theta=5e6)  # (transformers' default theta)
    rotary = rotary_dims(config, params, head_dim)

    def make_attention(i: int) -> nn.Module:
        return Attention(hidden, n_heads, n_kv, head_dim, qk_norm="full", eps=eps, rotary_dim=rotary)

    def make_mlp(i: int) -> nn.Module:
        return MiniMaxMoe(hidden, n_experts(config), top_k)

    return Decoder(
        config["vocab_size"], hidden, eps, n_layers, make_attention, make_mlp,
        Rope.build(params, rotary, config["max_position_embeddings"]), bool(config["tie_word_embeddings"]),
        list(range(n_layers)), (n_kv, head_dim, head_dim),
    )  # fmt: skip


def n_experts(config: dict[str, Any]) -> int:
    return int(config_get(config, "num_local_experts", "num_experts"))


def expert_width(config: dict[str, Any]) -> int:
    return int(config["intermediate_size"])
