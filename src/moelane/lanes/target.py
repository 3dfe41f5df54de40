"""The target side of the lanes engine: what it needs of the model it serves (`Target`), and its settings fitted to
that model (`fit_to_target`).

A target is anything with `new_cache`, `cache_for`, `forward(rows)`, `vocab_size`, `eos_ids` and `max_context`: `LM`,
or the fake of `moelane.lanes.fake`. With `capacity_for` too (the capacity `cache_for` gives), finished streams'
caches can serve later prompts with the same start (`moelane.lanes.prefix`). With `footprint()` too (what its passes
read, `moelane.model.footprint`; None for a model without routed experts), its rounds are priced by the bytes they
read (`moelane.lanes.cost`). `calibrate` measures the price of its passes by width, and of their further bytes.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from typing import Any, Protocol

import torch

from moelane.lanes.clock import Clock
from moelane.lanes.config import EngineConfig
from moelane.lanes.cost import ExpertPrices
from moelane.lanes.depth import Prices, PriceTable
from moelane.model.cache import Rows
from moelane.model.footprint import Footprint

log = logging.getLogger(__name__)
CALIBRATION_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
BYTE_WIDTHS = (2, 4, 8, 16)  # (passes of at most 16 rows: LM's compiled step reads a call's experts once per 16 rows)


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


def calibrate(target: Target, draft: Any, clock: Clock, max_rows: int) -> tuple[Prices, float | None]:
    """The price of a pass by width, measured before serving: the best of two passes each, of generated rows (as rounds
    feed them; through the compiled step, if any); and of one row of the `draft` model, if there is one. Rows of one
    token repeated, which route to one row's experts; for a target with a footprint, also passes of as many
    distinct tokens (each row of its own), whose extra time over the repeated token's prices its further bytes
    (`ExpertPrices`)."""

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
    table = PriceTable(points)
    shape = target_footprint(target)
    if shape is None:
        return table, draft_price
    per_byte = []
    for w in (w for w in BYTE_WIDTHS if w in dict(points)):
        spread = [(target.vocab_size - 1) * i // (w - 1) for i in range(w)]  # distinct tokens across the vocabulary
        extra = best_of_two(target, Rows(cache, spread, 0, decode=True)) - dict(points)[w]
        per_byte.append(extra / (shape.expected_bytes(w) - shape.expected_bytes(1)))
    return ExpertPrices(table, shape, max(0.0, statistics.median(per_byte)) if per_byte else 0.0), draft_price


def target_footprint(target: Target) -> Footprint | None:
    """What the target's passes read (`footprint()`), or None where it does not say (a dense model, the fake)."""
    method = getattr(target, "footprint", None)
    return method() if callable(method) else None
