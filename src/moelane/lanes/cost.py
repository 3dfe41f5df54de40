"""Round prices by the bytes a round reads (`ExpertPrices`), for a target that says what its passes read.

On an MoE whose experts do not fit in the caches, a decode round's time is mostly its weight reads: the dense
weights, and in each MoE layer every distinct expert its rows route to, once (`moelane.model.footprint`;
`bench/round_cost.py` measures rounds within 1.1-1.4x of that bound on the inflated model). Rows of different streams
mostly route to different experts; a stream's further rows (its drafts, the next positions of its text) mostly to
experts its own row already reads. So a round is priced

    price(rows, streams) = table(rows) + per_byte * (expected_bytes(spread) - expected_bytes(1))
    spread               = streams + DRAFT_SHARE * (rows - streams)

- `table`, a `PriceTable` by rows, holds what rows cost whatever experts they route to: a pass's fixed work, each
  row's own arithmetic, and one row's experts;
- `spread` counts the round's rows as independent rows: each stream's first row as one, every further row of a
  stream (a draft, a prompt row past the first) as DRAFT_SHARE of one, the share of a new stream's experts a draft
  row routes to that its round reads for nothing else;
- `expected_bytes(n)` is the footprint's: dense bytes, and in every MoE layer the experts n random rows are expected
  to pick, at their tier;
- `per_byte`, the seconds a further byte costs.

So a drafted row that routes to new experts costs their bytes, and 8 streams' rows cost what their distinct experts
cost, not 8 rows of one stream's. Calibration (`target.calibrate`) measures the table with passes of one token
repeated, whose rows all route to one row's experts, and per_byte from passes of as many distinct tokens, each a row
of its own. A measured round folds into the table at its rows net of its further bytes' price. On a model whose passes
cost their per-op work rather than their reads (the shipped model), per_byte comes out near 0 and prices are the
table's.
"""

from __future__ import annotations

from moelane.lanes.depth import PriceTable
from moelane.model.footprint import Footprint

# A draft row's new experts as a share of what one more independent row adds at its round's spread (the derivative
# of `expected_distinct`: 3.74 experts a layer at 1 row, 1.47 at 8, top-4 of 32). Counted with bench/round_fit.py
# (always-drafted copy engines, the new experts per MoE layer a draft row adds to its round) on the inflated model:
# 1.12 and 0.68 on copy-heavy prompts at 1 and 8 streams (0.30, 0.46), 2.55 and 1.21 on open ones (0.68, 0.82). The
# copy drafters hold drafts mostly on text they can copy; 0.4 held fewer there than paid (bench/ab.py, one
# copy-heavy stream: 0.86x of the table by rows), 0.25 as many.
DRAFT_SHARE = 0.3


class ExpertPrices:
    """`price(rows, streams)` = a table by rows + the price of the further bytes the round's spread reads."""

    __slots__ = ("footprint", "per_byte", "table")

    def __init__(self, table: PriceTable, footprint: Footprint, per_byte: float) -> None:
        if per_byte < 0:
            raise ValueError(f"per_byte must be >= 0, got {per_byte}")
        self.table, self.footprint, self.per_byte = table, footprint, per_byte

    @property
    def points(self) -> list[tuple[int, float]]:
        return self.table.points

    def further_bytes(self, rows: int, streams: int) -> float:
        """Bytes a round of `rows` rows over `streams` streams is expected to read beyond one row's."""
        streams = max(1, min(streams, rows))
        spread = streams + DRAFT_SHARE * (rows - streams)
        return self.footprint.expected_bytes(spread) - self.footprint.expected_bytes(1)

    def price(self, rows: int, streams: int = 1) -> float:
        return self.table.price(rows) + self.per_byte * self.further_bytes(rows, streams)

    def observe(self, rows: int, seconds: float, streams: int = 1) -> None:
        net = seconds - self.per_byte * self.further_bytes(rows, streams)
        self.table.observe(rows, max(net, 1e-9))
