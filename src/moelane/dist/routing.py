"""How often a model routes to each of its experts, counted in a `moelane trace` file (docs/trace-format.md): what
`--placement balanced` spreads evenly over the ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moelane.errors import InputError
from moelane.pager.trace import TraceError, TraceHeader, iter_segments


def routing_counts(path: str | Path, layers: list[int], n_experts: int, top_k: int) -> dict[int, list[int]]:
    """Each MoE layer's count of routed (token, expert) pairs per expert, over the whole trace at `path`, keyed by
    the model's layer index. InputError in one line for a missing or unreadable file, or a trace of a model with
    other MoE layers, experts or top-k."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"placement trace {path}: no such file")
    try:
        header, segments = iter_segments(path)
        check_shape(path, header, layers, n_experts, top_k)
        counts = np.zeros((len(layers), n_experts), np.int64)
        for segment in segments:  # expert_ids [T, L, K]
            for i in range(len(layers)):
                counts[i] += np.bincount(segment.expert_ids[:, i].reshape(-1).astype(np.int64), minlength=n_experts)
    except (TraceError, OSError, ValueError) as e:
        raise InputError(f"placement trace {path}: {str(e).removeprefix(f'{path}: ')}") from None
    if not counts.any():
        raise InputError(f"placement trace {path} holds no routed token: record one with `moelane trace record`")
    return {layer: counts[i].tolist() for i, layer in enumerate(layers)}


def check_shape(path: Path, header: TraceHeader, layers: list[int], n_experts: int, top_k: int) -> None:
    theirs = (header.n_layers, header.n_experts, header.top_k)
    if theirs != (len(layers), n_experts, top_k) or header.moe_layers not in ((), tuple(layers)):
        raise InputError(f"placement trace {path} is of another model: {theirs[0]} MoE layers of {theirs[1]} "
                         f"experts, top-{theirs[2]}; this model has {len(layers)} of {n_experts}, "
                         f"top-{top_k}")  # fmt: skip
