"""What a prefetch costs and what it can save: the least probability of use at which a load pays (docs/pager.md,
"Bigger than memory").

    r = disk time of one expert read (seconds a read took on its thread, over the loads in flight with it)
    h = compute it can hide behind: one MoE layer's compute for a load wanted later in this pass (`ahead` 0),
        one whole pass for one wanted by the next pass (`ahead` 1); never more than r is saved
    u = the disk's busy share of the wall time (a load that is not used delays the demand reads behind it only
        while the disk is busy)
    a load that is used saves min(h, r) of stall; one that is not costs r * u of disk time:
        load iff p * min(h, r) > (1 - p) * r * u,   i.e.   p > r * u / (r * u + min(h, r))

So on a fast disk or with small experts (r << h, the disk mostly idle) nearly any prediction pays, and with experts
that take milliseconds to read on a saturated disk only confident ones do: at least 1/2 when a whole pass hides the
read, more when one layer's compute is all there is. Every input is an exponential moving average (`ALPHA`) of
what the store measures; before the first of each is measured the threshold is 0 (every prediction loads).

A right prediction is not yet a used load: in a pool barely larger than one token's experts a load for the next
token is evicted before that token comes (or evicts what this token still needs). So each source's threshold is
divided by its yield factor: the share of its loads that were used, over the probability it predicted for them
(1 while they agree). Without new loads a source's yield drifts back to what it predicts (`FORGET` a pass), so a
source that stopped loading tries again later.
`least_probability` is the rule itself, a pure function: the replay (`moelane.pager.lab.ahead`) applies it to its
simulated disk and compute, so replay and live decide alike. `LoadPrice` is a plain object: `observe_*` in,
`threshold(ahead)` out; the store updates it under its lock. `Calibration` turns a predictor's score into the
probability of use it has measured for such scores.
"""

from __future__ import annotations

import numpy as np

ALPHA = 0.1  # weight of each new measurement
FORGET = 0.01  # a pass's drift of a source's yield back to the probability it predicts


def least_probability(read_s: float, hide_s: float, busy: float) -> float:
    """The least probability of use at which a load pays, p > r * u / (r * u + min(h, r)) (module docstring), for a
    read of `read_s` seconds of disk, `hide_s` seconds of compute to hide it behind and a disk busy `busy` of the
    time; 0 where a wasted load costs nothing."""
    cost = read_s * busy
    return cost / (cost + min(hide_s, read_s)) if cost > 0 else 0.0


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class LoadPrice:
    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.read_s: float | None = None  # disk time of one read
        self.layer_s: float | None = None  # compute between one MoE layer's call and the next's, stalls excluded
        self.busy: float | None = None  # disk busy share of the wall time
        self._busy_s = 0.0  # disk time since the last pass began
        self.predicted: dict[str, float] = {}  # per source, the probability of use of the loads it issued
        self.used: dict[str, float] = {}  # per source, the share of its loads that a pass used

    def observe_read(self, seconds: float, concurrent: int) -> None:
        """One disk read took `seconds` on its thread, with `concurrent` reads in flight (itself included)."""
        share = seconds / max(1, concurrent)
        self.read_s = ema(self.read_s, share)
        self._busy_s += share

    def observe_layer(self, seconds: float) -> None:
        self.layer_s = ema(self.layer_s, seconds)

    def observe_pass(self, seconds: float) -> None:
        """A pass took `seconds` of wall time, since the previous one began."""
        if seconds > 0:
            self.busy = ema(self.busy, min(1.0, self._busy_s / seconds))
        self._busy_s = 0.0
        for source, used in self.used.items():
            self.used[source] = used + FORGET * (self.predicted[source] - used)

    def observe_issue(self, source: str, p: float) -> None:
        """`source` issued a load it gave probability of use `p`."""
        self.predicted[source] = ema(self.predicted.get(source), p)

    def observe_outcome(self, source: str, used: bool) -> None:
        """A load `source` issued was used by a pass, or evicted or dropped unused."""
        if source in self.predicted:
            self.used[source] = ema(self.used.get(source), float(used))

    def factor(self, source: str) -> float:
        """Used share of `source`'s loads over the probability it predicted for them (1 before any outcome)."""
        used, predicted = self.used.get(source), self.predicted.get(source)
        if used is None or not predicted:
            return 1.0
        return min(2.0, used / predicted)

    def threshold(self, ahead: int, source: str | None = None) -> float:
        """The least probability of use at which a load of `source` pays (module docstring); 0 before
        measurements, above 1 where nothing does."""
        if self.read_s is None or self.layer_s is None or self.busy is None:
            return 0.0
        hide = self.layer_s * (1 if ahead == 0 else self.n_layers)
        least = least_probability(self.read_s, hide, self.busy)
        factor = 1.0 if source is None else self.factor(source)
        return least / factor if factor > 0 else float("inf")


class Calibration:
    """How often predictions of a given score came true: scores in [0, 1] in `n_bins` bins, each bin's hit rate
    with `PRIOR` pseudo-predictions at the score itself (so an unseen bin trusts the score)."""

    PRIOR = 4.0

    def __init__(self, n_bins: int = 10) -> None:
        self.n_bins = n_bins
        self.seen = np.zeros(n_bins)
        self.hits = np.zeros(n_bins)

    def _bin(self, score: float) -> int:
        return min(self.n_bins - 1, max(0, int(score * self.n_bins)))

    def add(self, score: float, hit: bool) -> None:
        b = self._bin(score)
        self.seen[b] += 1.0
        self.hits[b] += float(hit)

    def p(self, score: float) -> float:
        b, prior = self._bin(score), min(1.0, max(0.0, score))
        return float((self.hits[b] + self.PRIOR * prior) / (self.seen[b] + self.PRIOR))
