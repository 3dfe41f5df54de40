"""EMA scoreboards and the decay bandit (docs/design.md#the-pager), vectorised over arms and experts.

Scores live in one float32 array [A, M] (A decay arms, M = L * E flat expert ids `layer * E + expert`; float32
because numpy partitions it several times faster than float64, and the bandit partitions every token). Per token every
score is multiplied by its arm's decay d, then +1 for each expert the token routed to: d = 0 is last-token recency,
d = 0.99 nearly frequency. A segment of T tokens is folded in token by token, in closed form:
s <- d^T s + sum_t d^(T-1-t) a_t.

Bandit: before each segment is folded in, every arm predicts its top-`budget` experts from its current state and is
rewarded with the fraction of the segment's distinct experts that prediction covered: reward <- (1 - r) reward + r hit,
r = 0.3. The serving arm is the one with the highest reward; ties go to the lowest arm index (arms are listed in
increasing decay, so ties favour recency). A decode segment is one token, so there this is exactly "every token".

Top-n selection is deterministic everywhere: by score descending, then flat id ascending; experts with score 0 are
never selected by `top` (they carry no evidence).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from moelane.pager.trace import IntArray

ARMS = (0.0, 0.3, 0.6, 0.85, 0.95, 0.99)
REWARD_RATE = 0.3

FloatArray = npt.NDArray[np.float64]
ScoreArray = npt.NDArray[np.float32]


class Scoreboards:
    """EMA scores for several decays at once. `scores[a, m]`."""

    def __init__(self, n_ids: int, decays: tuple[float, ...] = ARMS) -> None:
        if not decays or any(not 0.0 <= d < 1.0 for d in decays):
            raise ValueError(f"decays must be non-empty and in [0, 1), got {decays}")
        self.decays = np.asarray(decays, np.float32)
        self.scores: ScoreArray = np.zeros((len(decays), n_ids), np.float32)

    def fold(self, token_ids: IntArray) -> None:
        """Fold in T tokens in order. token_ids: [T, n] flat ids routed by each token (distinct within a token)."""
        n_tokens = token_ids.shape[0]
        if n_tokens == 0:
            return
        if n_tokens == 1:
            self.scores *= self.decays[:, None]
            self.scores[:, token_ids[0]] += 1.0
            return
        n_ids = self.scores.shape[1]
        ages = np.arange(n_tokens - 1, -1, -1, dtype=np.float64)  # token t is T-1-t tokens old at the end
        flat = token_ids.reshape(-1)
        per = token_ids.shape[1]
        for a, d in enumerate(self.decays):
            w = np.repeat(d**ages, per)
            self.scores[a] *= d**n_tokens
            self.scores[a] += np.bincount(flat, weights=w, minlength=n_ids)

    def top(self, arm: int, n: int) -> IntArray:
        """The arm's top-n flat ids (score desc, id asc), excluding zero scores; sorted by rank."""
        s = self.scores[arm]
        live = np.flatnonzero(s > 0.0)
        if live.size > n:
            part = live[np.argpartition(-s[live], n - 1)[:n]]
            thr = s[part].min()
            live = np.flatnonzero(s >= thr)  # all ties at the threshold, resolved below by id
        order = np.lexsort((live, -s[live]))
        return np.asarray(live[order][:n], np.int64)


def top_hit_fraction(
    scores: ScoreArray, n: int, wanted: IntArray, thr: npt.NDArray[np.floating] | None = None
) -> FloatArray:
    """Per arm: fraction of `wanted` (distinct flat ids) inside that arm's top-n set (score desc, id asc, zero
    scores never predicted, as in `Scoreboards.top`). scores [A, M] -> [A]. `thr`: each arm's n-th largest score,
    when the caller knows it (else it is found here)."""
    n_arms, n_ids = scores.shape
    if wanted.size == 0:
        return np.ones(n_arms, np.float64)
    if n >= n_ids:
        return np.ones(n_arms, np.float64)
    if thr is None:
        thr = np.partition(scores, n_ids - n, axis=1)[:, n_ids - n]  # n-th largest per arm
    sw = scores[:, wanted]
    inside = (sw > thr[:, None]) & (sw > 0.0)
    tied = (sw == thr[:, None]) & (sw > 0.0)
    if tied.any():
        n_greater = (scores > thr[:, None]).sum(axis=1)
        for a in np.flatnonzero(tied.any(axis=1)):
            room = n - n_greater[a]
            tie_rank = np.cumsum(scores[a] == thr[a]) - 1  # rank among ties by id
            inside[a] |= tied[a] & (tie_rank[wanted] < room)
    return np.asarray(inside.mean(axis=1), np.float64)


class DecayBandit:
    """Arms = decays; picks the decay whose top-`budget` prediction has covered the most of recent segments."""

    def __init__(self, n_ids: int, decays: tuple[float, ...] = ARMS, reward_rate: float = REWARD_RATE) -> None:
        if not 0.0 < reward_rate <= 1.0:
            raise ValueError(f"reward_rate must be in (0, 1], got {reward_rate}")
        self.boards = Scoreboards(n_ids, decays)
        self.reward_rate = reward_rate
        self.rewards: FloatArray = np.zeros(len(decays), np.float64)
        self.last_hits: FloatArray = np.zeros(len(decays), np.float64)
        # Per arm the candidate set of `_thresholds` (for budget `_top_n`) and the ids folded in since.
        self._top_n = 0
        self._member = np.ones((len(decays), n_ids), np.bool_)
        self._since: list[IntArray] = []

    @property
    def best_arm(self) -> int:
        return int(np.argmax(self.rewards))  # first maximum: lowest index wins ties

    @property
    def best_decay(self) -> float:
        return float(self.boards.decays[self.best_arm])

    def observe(self, token_ids: IntArray, budget: int) -> None:
        """Reward every arm on this segment (from its state before it), then fold the segment in."""
        wanted = np.unique(token_ids) if token_ids.shape[0] > 1 else token_ids[0]  # one token's ids are distinct
        thr = self._thresholds(budget) if wanted.size else None
        self.last_hits = top_hit_fraction(self.boards.scores, budget, wanted, thr)
        r = self.reward_rate
        self.rewards = (1.0 - r) * self.rewards + r * self.last_hits
        self.boards.fold(token_ids)
        self._since.append(token_ids.reshape(-1))

    def _thresholds(self, n: int) -> npt.NDArray[np.float32] | None:
        """Each arm's n-th largest score, found among few candidates instead of all M ids.

        Per arm a set S is kept with every id outside it at or below every id inside, and outside ids all 0 while S
        has fewer than n. A fold multiplies an arm's scores by one factor (order kept, rounding monotone) and adds
        only to the ids it routes, so that still holds for S plus the ids routed since: the n-th largest lies among
        them (n + a segment's ids, against M). S is then cut to the ids at or above the n-th largest that score
        above 0. The first call, or a new n, looks at every id."""
        scores = self.boards.scores
        n_arms, n_ids = scores.shape
        if n >= n_ids:
            return None
        if self._top_n != n:
            self._member[:] = True
        else:
            for ids in self._since:
                self._member[:, ids] = True
        thr = np.zeros(n_arms, np.float32)
        for a in range(n_arms):
            cand = np.flatnonzero(self._member[a])
            vals = scores[a, cand]
            if vals.size >= n:
                thr[a] = np.partition(vals, vals.size - n)[vals.size - n]
            self._member[a, cand[(vals < thr[a]) | (vals <= 0.0)]] = False
        self._top_n, self._since = n, []
        return thr
