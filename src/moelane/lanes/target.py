"""The target side of the lanes engine: what it needs of the model it serves (`Target`), and its settings fitted to
that model (`fit_to_target`).

A target is anything with `new_cache`, `cache_for`, `forward(rows)`, `vocab_size`, `eos_ids` and `max_context`: `LM`,
or the fake of `moelane.lanes.fake`. With `capacity_for` too (the capacity `cache_for` gives), finished streams'
caches can serve later prompts with the same start (`moelane.lanes.prefix`). `calibrate` measures the price of its
passes by width.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

import torch

from moelane.lanes.clock import Clock
from moelane.lanes.config import EngineConfig
from moelane.lanes.depth import PriceTable
from moelane.model.cache import Rows

log = logging.getLogger(__name__)
CALIBRATION_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


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


def calibrate(target: Target, draft: Any, clock: Clock, max_rows: int) -> tuple[PriceTable, float | None]:
    """The price of a pass by width, measured before serving: the best of two passes each, of generated rows (as rounds
    feed them; through the compiled step, if any); and of one row of the `draft` model, if there is one."""

    def best_of_two(model: Any, rows: Rows) -> float:
        seconds = []
        for _ in range(2):
            t0 = clock.now()
            model.forward([rows])
            seconds.append(clock.now() - t0)
        return min(seconds)

    widths = [w for w in CALIBRATION_WIDTHS if w <= min(max_rows, target.max_context)]  # (a cache holds the rows)
    cache = target.new_cache(widths[-1])
    points = [(w, max(best_of_two(target, Rows(cache, [0] * w, 0, decode=True)), 1e-9)) for w in widths]
    draft_price = None if draft is None else best_of_two(draft, Rows(draft.cache_for(1, 1), [0], 0, decode=True))
    return PriceTable(points), draft_price
