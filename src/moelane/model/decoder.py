"""The decoder stack every family shares: embed, N x (norm, attention, norm, MLP or MoE), norm, LM head.

A family builds one `Decoder` from its config by saying what its attention and its MoE block are (and its dense MLP,
where it is not the plain SwiGLU of `dense_width`). Parameter names are those of Hugging Face checkpoints
(`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`), so dense weights load with no renaming. Expert weights
are not parameters: they live in the provider's pools.

A feed-forward block is called as `block(x, layer, provider, routing)`; MoE blocks append their (ids, weights) to
`routing`, dense blocks ignore both. A MoE block's `route(x) -> (weights, ids)` [T, K] is its router alone: the
pager's look-ahead applies it to an earlier layer's input to guess which experts the block will want.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from moelane.errors import ModelLoadError
from moelane.model.attention import Batch
from moelane.model.config import Config
from moelane.model.layers import MLP, RMSNorm, linear
from moelane.model.moe import Routing
from moelane.model.provider import ExpertProvider
from moelane.model.rope import Rope


class DenseMlp(MLP):
    """A dense MLP layer with the feed-forward call signature (parameter names as in checkpoints)."""

    def forward(self, x: torch.Tensor, layer: int, provider: ExpertProvider, routing: Routing) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


Norm = Callable[[int, float], nn.Module]  # (dim, eps) -> a norm: RMSNorm, or Phi-MoE's nn.LayerNorm
Make = Callable[[], nn.Module]


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
    """A whole causal LM. `forward` runs one pass over a `Batch` of stream rows and returns the final hidden states.

    `attention(i)` is layer i's attention; `moe()` the MoE block of the layers `config.moe_layers()` names, `dense()`
    the MLP of the others (by default SwiGLU of `config.dense_width`). Every layer caches `cache_shape` (KV heads, key
    width, value width; by default the config's attention heads')."""

    def __init__(
        self,
        config: Config,
        attention: Callable[[int], nn.Module],
        rope: Rope,
        *,
        moe: Make | None = None,
        dense: Make | None = None,
        norm: Norm = RMSNorm,
        cache_shape: tuple[int, int, int] | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.moe_layers = config.moe_layers()
        assert moe is not None or not self.moe_layers

        def mlp(i: int) -> nn.Module:
            if i in self.moe_layers:
                assert moe is not None
                return moe()
            return dense() if dense is not None else DenseMlp(hidden, dense_width(config))

        layers = [DecoderLayer(hidden, eps, attention(i), mlp(i), norm) for i in range(config.num_hidden_layers)]
        self.model = Stack(config.vocab_size, hidden, eps, layers, norm)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = rope
        self._cache_shape = cache_shape or (config.n_kv_heads, config.head_size, config.head_size)

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
        return linear(hidden, self.lm_head.weight, self.lm_head.bias, exact_out=True).float()  # (a family's bias too)


def dense_width(config: Config) -> int:
    assert config.dense_width is not None  # (`Config` checks it where a layer is dense)
    return config.dense_width


def sliding_windows(
    n_layers: int, window: int | None, layer_types: list[str] | None = None, by_layer_types: bool = False
) -> list[int | None]:
    """Per layer, its sliding attention window (None: full attention), as transformers reads the config. No window
    where `window` is 0 or None. Mixtral (`by_layer_types` false): the window in every layer. Qwen (true; its window
    is given only where `use_sliding_window` is set): in the layers `layer_types` marks "sliding_attention", and a
    config without `layer_types` is refused, since the layer rule differs by family and version."""
    if not window:
        return [None] * n_layers
    if window < 1:
        raise ModelLoadError(f"sliding_window must be a positive number of positions, got {window!r}")
    if not by_layer_types:
        return [window] * n_layers
    if layer_types is None:
        raise ModelLoadError("config.json sets use_sliding_window but has no layer_types to say which layers")
    if len(layer_types) != n_layers:
        raise ModelLoadError(f"config.json has {len(layer_types)} layer_types for {n_layers} layers")
    return [window if t == "sliding_attention" else None for t in layer_types]


def sparse_layers(n_layers: int, step: int, dense: list[int] | None) -> list[int]:
    """Qwen's MoE layers: every `step`-th (`decoder_sparse_step`), but for the `dense` ones (`mlp_only_layers`)."""
    return [i for i in range(n_layers) if i not in (dense or []) and (i + 1) % step == 0]
