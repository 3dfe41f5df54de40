"""The target side of the lanes engine: what it needs of the model it serves (`Target`), and its settings fitted to
that model (`fit_to_target`).

A target is anything with `new_cache`, `cache_for`, `forward(rows)`, `vocab_size`, `eos_ids` and `max_context`: `LM`,
or the fake of `moelane.lanes.fake`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

import torch

from moelane.lanes.config import EngineConfig
from moelane.model.cache import Rows

log = logging.getLogger(__name__)


class Target(Protocol):
    vocab_size: int
    eos_ids: frozenset[int]
    max_context: int

    def new_cache(self, capacity: int) -> Any: ...

    def cache_for(self, n_prompt: int, max_tokens: int) -> Any: ...

    def forward(self, rows: list[Rows], last_only: bool = False) -> list[torch.Tensor]:
        """Logits [n_i, vocab] per stream, or [1, vocab] of each stream's last row if `last_only`."""
        ...


def fit_to_target(config: EngineConfig, target: Target) -> EngineConfig:
    """`config` with rounds no bigger than one pass of `target` may be: a pager's small expert pool must hold every
    expert one MoE layer's rows route to at once (`LM.max_pass_rows`), so rows, streams per round and prefill chunks
    are capped to what it holds."""
    limit = getattr(target, "max_pass_rows", None)
    rows = limit() if callable(limit) else None
    if rows is None or rows >= config.max_rows:
        return config
    log.warning("the expert memory holds the experts of %d rows per MoE layer: rounds take at most %d rows "
                "(%d streams)", rows, rows, min(config.max_streams, rows))  # fmt: skip
    return replace(config, max_rows=rows, max_streams=min(config.max_streams, rows),
                   prefill_chunk=min(config.prefill_chunk, rows))  # fmt: skip
