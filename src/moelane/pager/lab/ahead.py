"""Which look-ahead predictions the replay loads: the live store's rule (docs/pager.md, "Bigger than memory").

Live, `LookAhead` turns each prediction's score into the probability of use measured for such scores (`Calibration`)
and loads it only where that reaches `LoadPrice.threshold(0, "lookahead")`. The replay uses the same two objects, so
the same `least_probability`, fed from its cost model instead of clocks:

    r = a batch's disk time (latency + bytes / bandwidth) shared among the experts it loads
    h = compute_floor / L: the one layer's compute that a look-ahead load hides behind
    u = each pass's disk time over its wall time (stall + compute_floor per token; the cost model has no other
        compute figure, so a prefill chunk counts compute_floor per token too)
    outcome of a load: used by a later step, or evicted before any (the source's yield factor)

Scores: traces carry the look-ahead's top-K ids in router order but not the router's weights, so the j-th of K scores
1 - j / K (an unseen bin trusts rank 0 fully and the last rank at 1 / K), and the calibration learns each rank's hit
rate from the trace as it replays, as live learns each weight bin's. With `priced` False every prediction loads.
"""

from __future__ import annotations

import numpy as np

from moelane.pager.price import Calibration, LoadPrice
from moelane.pager.trace import IntArray

SOURCE = "lookahead"


class AheadPrice:
    """The look-ahead's admission in one replay: `choose` what to load, `routed` to calibrate; `read`, `issued`,
    `outcome` and `end_pass` feed the price what the simulated disk and passes did."""

    def __init__(self, n_layers: int, compute_floor: float, priced: bool = True) -> None:
        self.price = LoadPrice(n_layers)
        self.price.observe_layer(compute_floor / n_layers)  # (the cost model's layer compute is a constant)
        self.calibration = Calibration()
        self.priced = priced
        self._scores: dict[int, float] = {}  # flat id -> score: the predictions for the next step

    def choose(self, predicted: IntArray) -> tuple[IntArray, float]:
        """[T, K] flat ids named for the next layer -> (the distinct ids to load, sorted; their mean probability)."""
        k = predicted.shape[1]
        scores: dict[int, float] = {}
        for row in predicted.tolist():
            for j, key in enumerate(row):
                scores[key] = max(scores.get(key, 0.0), 1.0 - j / k)
        self._scores = scores
        least = self.price.threshold(0, SOURCE) if self.priced else 0.0
        odds = {key: p for key, score in scores.items() if (p := self.calibration.p(score)) >= least}
        return np.array(sorted(odds), np.int64), (sum(odds.values()) / len(odds) if odds else 0.0)

    def routed(self, ids: IntArray) -> None:
        """The step the pending predictions were for ran with `ids`."""
        used = set(ids.tolist())
        for key, score in self._scores.items():
            self.calibration.add(score, key in used)
        self._scores = {}

    def read(self, seconds: float, n_loads: int) -> None:
        """One batch of `n_loads` experts took `seconds` of disk."""
        for _ in range(n_loads):
            self.price.observe_read(seconds, n_loads)

    def issued(self, n_loads: int, p: float) -> None:
        for _ in range(n_loads):
            self.price.observe_issue(SOURCE, p)

    def outcome(self, used: bool, n_loads: int) -> None:
        for _ in range(n_loads):
            self.price.observe_outcome(SOURCE, used)

    def end_pass(self, seconds: float) -> None:
        self.price.observe_pass(seconds)

    def threshold(self) -> float:
        return self.price.threshold(0, SOURCE)
