"""Recording routing traces from a live model: `TraceRecorder` is a `RoutingObserver` that writes each forward
pass's routing as one trace segment. Torch stays here; trace.py is numpy only.

Bytes per expert: tier 0 is the checkpoint's own tensors (sum of the expert's `TensorRef.nbytes`); int8 and int4
tiers are estimates for group-wise quantisation with one 2-byte scale per 64 weights, until the store (issue 5)
records the real sizes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from moelane.pager.trace import TraceHeader, TraceWriter


def header_from_lm(lm: Any, model: str = "") -> TraceHeader:
    """Trace header (shape, tiers) of a loaded `moelane.LM`."""
    moe_layers = list(lm.moe_layers)
    first = lm.expert_handles[moe_layers[0]][0]
    nbytes = sum(ref.nbytes for ref in first.tensors.values())
    n_weights = sum(math.prod(ref.shape) for ref in first.tensors.values())
    dtype = next(iter(first.tensors.values())).dtype.lower()
    scales = 2 * math.ceil(n_weights / 64)
    return TraceHeader(
        n_layers=len(moe_layers),
        n_experts=int(lm.args.num_experts),
        top_k=int(lm.args.num_experts_per_tok),
        tiers=((dtype, nbytes), ("int8", n_weights + scales), ("int4", math.ceil(n_weights / 2) + scales)),
        moe_layers=tuple(moe_layers),
        model=model or str(getattr(lm, "folder", "")),
    )


class TraceRecorder:
    """Writes one segment per observed forward pass. `stream` overrides the record's stream ids (e.g. one id per
    request when the engine runs requests one at a time)."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
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
        self.writer.write_segment(ids, weights, record.phase, streams)
        self.n_segments += 1


@contextmanager
def open_recorder(path: str | Path, lm: Any, model: str = "") -> Iterator[TraceRecorder]:
    """Record every forward pass of `lm` to `path` while the block runs (for `moelane run --trace FILE`)."""
    with TraceWriter(path, header_from_lm(lm, model)) as writer:
        recorder = TraceRecorder(writer)
        lm.observers.append(recorder)
        try:
            yield recorder
        finally:
            lm.observers.remove(recorder)
