"""Router and expert dispatch: route first, then ask the provider for the experts' pool slots, then compute.

The block never loads an expert: `provider.slots(layer, ids)` makes the routed experts resident and names their pool
slots, `provider.weights(layer)` hands over the pool tensors, and the block gathers by slot.

Two dispatch paths give bit-identical rows (both run every (token, expert) pair through `linear`, whose tile padding
makes a row's result independent of the other rows in its tile):
- eager: count routings per slot first (`bincount`), then compute only the slots used, each over its rows;
- compiled: one fixed-shape step per (token, expert) pair, no Python scalar from a tensor, so decode compiles whole.

Shape alphabet: T tokens, K top-k, E experts, S pool slots, H hidden, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moelane.model.layers import linear
from moelane.model.provider import ExpertProvider


def softmax_topk(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k; renormalise them to sum 1 when `norm`. -> (weights, ids) [T, K]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU on rows x [n, H]; w13 [2I, H], w2 [H, I]."""
    gate, up = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


def dispatch(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Sum over k of weights[t, k] * expert(slots[t, k])(x[t]). x [T, H]; slots, weights [T, K]."""
    n_tokens, k = slots.shape
    flat = slots.reshape(-1)
    if torch.compiler.is_compiling():
        ys = [
            expert_mlp(
                x[j // k : j // k + 1], w13.index_select(0, flat[j : j + 1])[0], w2.index_select(0, flat[j : j + 1])[0]
            )
            for j in range(n_tokens * k)
        ]
        y = torch.cat(ys, dim=0)
    else:
        y = x.new_empty(n_tokens * k, x.shape[1])
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
        start = 0
        for slot, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            y[pairs] = expert_mlp(x[pairs // k], w13[slot], w2[slot])
            start += count
    # Weighted sum over k in a fixed order: the same for every row, whatever the batch.
    return (y.view(n_tokens, k, -1) * weights.to(x.dtype)[..., None]).sum(dim=1)


def run_experts(
    x: torch.Tensor, layer: int, ids: torch.Tensor, weights: torch.Tensor, provider: ExpertProvider
) -> torch.Tensor:
    slots = provider.slots(layer, ids)
    w13, w2 = provider.weights(layer)
    return dispatch(x, slots, weights, w13, w2)
