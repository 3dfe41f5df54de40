"""Predictors of the next token's experts, measured before they are trusted (docs/design.md#prediction-and-prefetch).

- Repeat: the previous token's experts (what a recency store already has).
- Cross-token co-occurrence: noisy-OR over observed transitions, per layer: P(b | prev set A) = 1 - prod_{a in A}
  (1 - c[a -> b] / n[a]), learned online from the trace so far (no look at the future); it names the `n_extra`
  most likely experts per layer outside the previous token's set.
- Next-layer look-ahead (apply layer l+1's router to the hidden state entering layer l's MoE block, as
  mixtral-offloading does) needs hidden states, which traces do not carry: the recorder writes its predictions into
  the trace instead (`moelane.pager.live.recorder`), and analyze.py scores them with `predictor_stats`.

Measures per decode token t with experts D_t: repeat recall = |D_t & D_{t-1}| / |D_t|; delta recall = share of
D_t - D_{t-1} the predictor named; schedulable coverage = |D_t & (D_{t-1} | predicted)| / |D_t|.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moelane.pager.lab.replay import FloatArray
from moelane.pager.trace import IntArray


class CooccurrencePredictor:
    """Per-layer transition counts between consecutive tokens of a stream. ids: [L, K] expert ids (not flat)."""

    def __init__(self, n_layers: int, n_experts: int) -> None:
        self.counts: FloatArray = np.zeros((n_layers, n_experts, n_experts), np.float64)
        self.seen: FloatArray = np.zeros((n_layers, n_experts), np.float64)
        self._rows = np.arange(n_layers)[:, None, None]

    def observe(self, prev: IntArray, cur: IntArray) -> None:
        n_layers, k = prev.shape
        rows = np.broadcast_to(self._rows, (n_layers, k, cur.shape[1]))
        np.add.at(self.counts, (rows, prev[:, :, None], cur[:, None, :]), 1.0)
        np.add.at(self.seen, (self._rows[:, :, 0], prev), 1.0)

    def predict(self, prev: IntArray, n_extra: int) -> IntArray:
        """[L, n_extra] most likely experts per layer outside `prev` (-1 where nothing has probability > 0)."""
        rows = self._rows[:, :, 0]
        p = self.counts[rows, prev] / np.maximum(self.seen[rows, prev], 1.0)[:, :, None]  # [L, K, E]
        prob = 1.0 - np.prod(1.0 - p, axis=1)  # [L, E]
        prob[rows, prev] = 0.0
        order = np.argsort(-prob, axis=1, kind="stable")[:, :n_extra]
        return np.where(np.take_along_axis(prob, order, axis=1) > 0.0, order, -1)


def predictor_stats(pairs: list[tuple[IntArray, IntArray]], pred: list[IntArray]) -> dict[str, Any]:
    """pairs: (previous ids [L, K], current ids [L, K]) per decode token; pred: predicted extra ids [L, n]."""
    if not pairs:
        return {"n_tokens": 0, "repeat_recall": 0.0, "delta_recall": 0.0, "schedulable_coverage": 0.0}
    rep, new, new_hit, total = 0, 0, 0, 0
    for (prev, cur), extra in zip(pairs, pred, strict=True):
        for layer in range(cur.shape[0]):
            c = set(cur[layer].tolist())
            r = c & set(prev[layer].tolist())
            rest = c - r
            rep += len(r)
            new += len(rest)
            new_hit += len(rest & set(extra[layer].tolist()))
            total += len(c)
    return {
        "n_tokens": len(pairs),
        "repeat_recall": rep / total,
        "delta_recall": new_hit / new if new else 1.0,
        "schedulable_coverage": (rep + new_hit) / total,
    }
