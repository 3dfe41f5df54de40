import numpy as np

from moelane.pager.scoreboard import ARMS, DecayBandit, Scoreboards, top_hit_fraction


def reference_scores(tokens: list[list[int]], decay: float, n_ids: int) -> np.ndarray:
    s = [0.0] * n_ids
    for tok in tokens:
        s = [v * decay for v in s]
        for i in tok:
            s[i] += 1.0
    return np.array(s)


def reference_top(scores: np.ndarray, n: int, keep_zero: bool = False) -> set[int]:
    ids = [i for i in range(scores.size) if keep_zero or scores[i] > 0]
    return set(sorted(ids, key=lambda i: (-scores[i], i))[:n])


def test_fold_matches_token_by_token_reference() -> None:
    rng = np.random.default_rng(1)
    n_ids = 20
    tokens = [rng.choice(n_ids, 4, replace=False).tolist() for _ in range(40)]
    boards = Scoreboards(n_ids)
    i = 0
    while i < len(tokens):  # segments of mixed length
        n = int(rng.integers(1, 6))
        boards.fold(np.array(tokens[i : i + n], np.int64))
        i += n
    for a, d in enumerate(ARMS):
        assert np.allclose(boards.scores[a], reference_scores(tokens, d, n_ids), rtol=1e-5, atol=1e-5)


def test_decay_zero_is_last_token_and_top_breaks_ties_by_id() -> None:
    boards = Scoreboards(10, (0.0,))
    boards.fold(np.array([[1, 2, 3], [7, 5, 4]], np.int64))
    assert set(np.flatnonzero(boards.scores[0]).tolist()) == {4, 5, 7}
    assert boards.top(0, 2).tolist() == [4, 5]
    assert boards.top(0, 10).tolist() == [4, 5, 7]  # zero scores never selected


def test_top_hit_fraction_matches_reference_with_ties() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        scores = rng.integers(0, 4, size=(3, 15)).astype(np.float64)  # many ties
        n = int(rng.integers(1, 15))
        wanted = np.unique(rng.choice(15, 5))
        got = top_hit_fraction(scores, n, wanted)
        for a in range(3):
            ref = reference_top(scores[a], n)
            assert got[a] == sum(1 for w in wanted.tolist() if w in ref) / wanted.size
        boards = Scoreboards(15, (0.5, 0.5, 0.5))
        boards.scores[:] = scores
        for a in range(3):
            assert set(boards.top(a, n).tolist()) == reference_top(scores[a], n)


def test_bandit_rewards_follow_the_ema_and_ties_go_to_lowest_arm() -> None:
    bandit = DecayBandit(8)
    assert bandit.best_arm == 0
    bandit.observe(np.array([[0, 1]], np.int64), budget=2)
    assert np.all(bandit.rewards == 0.0)  # nothing seen yet: every arm predicted nothing
    bandit.observe(np.array([[0, 1]], np.int64), budget=2)
    assert np.allclose(bandit.rewards, 0.3)  # every arm predicted {0, 1}: hit 1.0, reward 0.7*0 + 0.3*1
    assert bandit.best_arm == 0


def test_bandit_prefers_frequency_on_a_stable_hot_set_and_recency_after_shifts() -> None:
    rng = np.random.default_rng(3)
    n_ids, budget = 64, 8
    stable = DecayBandit(n_ids)
    hot = np.arange(8)
    for _ in range(300):  # 6 of 8 from a fixed hot set, 2 random: frequency wins
        tok = np.concatenate([rng.choice(hot, 6, replace=False), rng.choice(np.arange(8, 64), 2, replace=False)])
        stable.observe(tok[None].astype(np.int64), budget)
    assert stable.best_decay >= 0.85
    shifting = DecayBandit(n_ids)
    for t in range(300):  # the whole set moves every 3 tokens: only recency keeps up
        base = (t // 3) * 8 % n_ids
        tok = (base + rng.choice(8, 6, replace=False)) % n_ids
        shifting.observe(tok[None].astype(np.int64), budget)
    assert shifting.best_decay <= 0.6


def test_bandit_thresholds_from_candidates_equal_a_full_partition() -> None:
    """The bandit finds each arm's n-th largest score among its last top set and the ids routed since; rewards must
    equal those from partitioning every score, through segments of mixed length, ties and budget changes."""
    rng = np.random.default_rng(4)
    n_ids = 96
    bandit, reference = DecayBandit(n_ids), DecayBandit(n_ids)
    budget = 20
    for step in range(400):
        if step % 97 == 0:
            budget = int(rng.integers(1, n_ids + 4))
        n_tokens = 1 if step % 5 else int(rng.integers(2, 9))
        hot = rng.integers(0, 4) * 8  # a moving hot region, so sets change and scores tie often
        tokens = np.stack([np.sort(rng.choice(np.arange(hot, hot + 24), 6, replace=False)) for _ in range(n_tokens)])
        wanted = np.unique(tokens)
        expected = top_hit_fraction(reference.boards.scores, budget, wanted)
        bandit.observe(tokens.astype(np.int64), budget)
        reference.boards.fold(tokens.astype(np.int64))
        assert np.array_equal(bandit.last_hits, expected), step
        assert np.array_equal(bandit.boards.scores, reference.boards.scores)
