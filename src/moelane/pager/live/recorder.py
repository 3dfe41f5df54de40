"""Recording routing traces from a live model: `TraceRecorder` is a `RoutingObserver` that writes each forward
pass's routing as one trace segment, with the next-layer look-ahead's predictions when a `LookAheadTap` is hooked to
the model (as `open_recorder` does). Torch stays here; `moelane.pager.trace` is numpy only.

Bytes per expert: tier 0 is the checkpoint's own tensors (sum of the expert's `TensorRef.nbytes`); int8 and int4
tiers are estimates for group-wise quantisation with one 2-byte scale per 64 weights (a trace is recorded apart from
any store, so it holds no pool's real sizes).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from moelane.errors import InputError
from moelane.pager.live.prefetch import next_gates
from moelane.pager.trace import TraceHeader, TraceWriter


def header_from_lm(lm: Any, model: str = "") -> TraceHeader:
    """Trace header (shape, tiers) of a loaded `moelane.LM`."""
    moe_layers = list(lm.moe_layers)
    if not moe_layers:
        raise InputError("this model has no experts (a dense model): there is no routing to trace")
    first = lm.expert_handles[moe_layers[0]][0]
    hidden, width = first.dims
    n_weights = 3 * hidden * width
    dtype = "mxfp4" if first.layout == "mxfp4" else next(iter(first.tensors.values())).dtype.lower()
    scales = 2 * math.ceil(n_weights / 64)
    return TraceHeader(
        n_layers=len(moe_layers),
        n_experts=int(lm.args.num_experts),
        top_k=int(lm.args.num_experts_per_tok),
        tiers=((dtype, first.nbytes), ("int8", n_weights + scales), ("int4", math.ceil(n_weights / 2) + scales)),
        moe_layers=tuple(moe_layers),
        model=model or str(getattr(lm, "folder", "")),
    )


class LookAheadTap:
    """Forward pre-hooks that apply layer l+1's router to the input of layer l's MoE block, as the live store's
    look-ahead does (docs/design.md#prediction-and-prefetch), and keep each pass's per-token top-K for the trace.
    `take()` returns them as [T, L-1, K] and clears them; None when a MoE block has no `route` to apply (no prediction
    made)."""

    def __init__(self, lm: Any) -> None:
        layers = list(lm.moe_layers)
        self.gates = next_gates(lm, layers)
        self.complete = len(layers) > 1 and len(self.gates) == len(layers) - 1
        self._order = {layer: i for i, layer in enumerate(layers[:-1])}
        self._rows: dict[int, torch.Tensor] = {}
        self._hooks = []
        if self.complete:
            for layer in self.gates:
                block = lm.model.model.layers[layer].mlp
                hook = block.register_forward_pre_hook(lambda m, args, layer=layer: self._see(layer, args[0]))
                self._hooks.append(hook)

    def _see(self, layer: int, x: torch.Tensor) -> None:
        _, route = self.gates[layer]
        self._rows[self._order[layer]] = route(x)[1].detach().cpu()

    def take(self) -> npt.NDArray[Any] | None:
        rows, self._rows = self._rows, {}
        if not self.complete or len(rows) != len(self._order):
            return None
        return torch.stack([rows[i] for i in range(len(self._order))], dim=1).numpy()  # [T, L-1, K]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class TraceRecorder:
    """Writes one segment per observed forward pass. `stream` overrides the record's stream ids (e.g. one id per
    request when the engine runs requests one at a time). With a `tap`, each segment carries the look-ahead."""

    def __init__(self, writer: TraceWriter, tap: LookAheadTap | None = None) -> None:
        self.writer = writer
        self.tap = tap
        self.stream: int | None = None
        self.n_segments = 0

    def observe(self, record: Any) -> None:
        ids = record.expert_ids.detach().permute(1, 0, 2).cpu().numpy()  # [L, T, K] -> [T, L, K]
        weights = record.weights.detach().float().permute(1, 0, 2).cpu().numpy()
        n_tokens = ids.shape[0]
        if self.stream is not None or not record.stream_ids:
            streams = np.full(n_tokens, self.stream or 0, np.int64)
        else:
            streams = np.asarray(record.stream_ids, np.int64)
        ahead = self.tap.take() if self.tap is not None else None
        if ahead is not None and ahead.shape[0] != n_tokens:
            ahead = None  # the pass's hooks and its routing record disagree (should not happen): record without it
        self.writer.write_segment(ids, weights, record.phase, streams, ahead)
        self.n_segments += 1


@contextmanager
def open_recorder(path: str | Path, lm: Any, model: str = "", lookahead: bool = True) -> Iterator[TraceRecorder]:
    """Record every forward pass of `lm` to `path` while the block runs (for `moelane run --trace FILE`), with the
    look-ahead's predictions unless `lookahead` is False or the model's routers do not allow it."""
    tap = LookAheadTap(lm) if lookahead else None
    with TraceWriter(path, header_from_lm(lm, model)) as writer:
        recorder = TraceRecorder(writer, tap if tap is not None and tap.complete else None)
        lm.observers.append(recorder)
        try:
            yield recorder
        finally:
            lm.observers.remove(recorder)
            if tap is not None:
                tap.remove()
