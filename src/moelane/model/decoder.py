"""The decoder stack most MoE families share: embed, N x (norm, attention, norm, MLP or MoE), norm, LM head.

A family file builds one `Decoder` from its config by saying what its attention and its feed-forward blocks are.
Parameter names are those of Hugging Face checkpoints (`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`),
so dense weights load with `load_state_dict` and need no renaming. Expert weights are not parameters: they live in
the provider's pools.

A feed-forward block is called as `block(x, layer, provider, routing)`; MoE blocks append their (ids, weights) to
`routing`, dense blocks ignore both. A MoE block's `route(x) -> (weights, ids)` [T, K] is its router alone: the
pager's look-ahead applies it to an earlier layer's input to guess which experts the block will want.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from moelane.model.attention import Batch
from moelane.model.checkpoint import LAYER
from moelane.model.layers import MLP, RMSNorm, Rope, linear
from moelane.model.provider import ExpertProvider

Routing = list[tuple[torch.Tensor, torch.Tensor]]


class FeedForward(Protocol):
    def __call__(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor: ...


class DenseMlp(MLP):
    """A dense MLP layer with the feed-forward call signature (parameter names as in checkpoints)."""

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


Norm = Callable[[int, float], nn.Module]  # (dim, eps) -> a norm: RMSNorm, or Phi-MoE's nn.LayerNorm


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, eps: float, attention: nn.Module, mlp: nn.Module, norm: Norm = RMSNorm) -> None:
        super().__init__()
        self.input_layernorm = norm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = norm(hidden, eps)
        self.mlp = mlp


class Stack(nn.Module):
    def __init__(self, vocab: int, hidden: int, eps: float, layers: list[DecoderLayer], norm: Norm = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(hidden, eps)


class Decoder(nn.Module):
    """A whole causal LM. `forward` runs one pass over a `Batch` of stream rows and returns the final hidden states."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        eps: float,
        n_layers: int,
        make_attention: Callable[[int], nn.Module],
        make_mlp: Callable[[int], nn.Module],
        rope: Rope,
        tie_embeddings: bool,
        moe_layers: list[int],
        cache_shape: tuple[int, int, int],
        norm: Norm = RMSNorm,
    ) -> None:
        super().__init__()
        layers = [DecoderLayer(hidden, eps, make_attention(i), make_mlp(i), norm) for i in range(n_layers)]
        self.model = Stack(vocab, hidden, eps, layers, norm)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = rope
        self.moe_layers = moe_layers
        self._cache_shape = cache_shape

    def cache_shapes(self) -> dict[int, tuple[int, int, int]]:
        return {i: self._cache_shape for i in range(len(self.model.layers))}

    def forward(self, tokens: torch.Tensor, batch: Batch, provider: ExpertProvider, routing: Routing) -> torch.Tensor:
        """tokens [N] -> hidden [N, H]. MoE layers append their routing to `routing` in layer order."""
        x = self.model.embed_tokens(tokens)
        rope = self.rope.cos_sin(batch.positions, x.dtype)
        for i, layer in enumerate(cast(list[DecoderLayer], self.model.layers)):
            x = x + layer.self_attn(layer.input_layernorm(x), i, batch, rope)
            x = x + layer.mlp(layer.post_attention_layernorm(x), i, provider, routing)
        return cast(torch.Tensor, self.model.norm(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head.weight, self.lm_head.bias).float()  # (a bias where a family gives one)


REQUIRED = object()


def attention_heads(config: dict[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a config: KV heads default to the query heads (no GQA), the head dim to
    hidden size / query heads. (transformers' classes default KV heads to a number of their own instead, which
    hub configs always override; a checkpoint whose K/V projections disagree is refused at load, by their shapes.)"""
    n_heads = config["num_attention_heads"]
    return (
        n_heads,
        config.get("num_key_value_heads") or n_heads,
        config.get("head_dim") or config["hidden_size"] // n_heads,
    )


def config_get(config: dict[str, Any], *names: str, default: Any = REQUIRED) -> Any:
    """The first of several hub spellings present in a config (e.g. num_experts / num_local_experts); KeyError
    naming the first spelling when none is there and there is no `default` (`load` turns it into a clear line)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    if default is REQUIRED:
        raise KeyError(names[0])
    return default


def past_last_layer(config: dict[str, Any], name: str) -> bool:
    """Whether a checkpoint tensor belongs to a layer past the decoder's `num_hidden_layers`: the multi-token-prediction
    layers GLM-4.5 and DeepSeek-V3 ship (`num_nextn_predict_layers`), which plain decoding does not use."""
    match = LAYER.match(name)
    return match is not None and int(match.group(1)) >= int(config["num_hidden_layers"])


def is_moe_layer(config: dict[str, Any], i: int) -> bool:
    """Qwen-style placement: `mlp_only_layers` are dense, else every `decoder_sparse_step`-th layer is MoE."""
    if i in (config.get("mlp_only_layers") or []):
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return (i + 1) % step == 0


def sliding_windows(config: dict[str, Any], flagged: bool) -> list[int | None]:
    """Per layer, its sliding attention window (None: full attention), as transformers reads the config.

    Mixtral (`flagged` false): `sliding_window`, when set, windows every layer. Qwen (`flagged`): only when
    `use_sliding_window` is true (its default is false), and then the layers `layer_types` marks
    "sliding_attention" (transformers writes the list into config.json); a Qwen config with `use_sliding_window: true`
    and no `layer_types` is refused: the layer rule differs by family and version. Llama has no windows.
    """
    from moelane.errors import ModelLoadError

    n_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window")
    if not window or (flagged and not config.get("use_sliding_window")):
        return [None] * n_layers
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
    if not flagged:
        return [window] * n_layers
    types = config.get("layer_types")
    if types is None:
        raise ModelLoadError("config.json sets use_sliding_window but has no layer_types to say which layers")
    if len(types) != n_layers:
        raise ModelLoadError(f"config.json has {len(types)} layer_types for {n_layers} layers")
    return [window if t == "sliding_attention" else None for t in types]
