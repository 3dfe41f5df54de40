"""The shared guard (SPEC 3.2-3.4) on its own: its choices, its ever rarer re-measures of the losing mode, skipped
first rounds, one allocation per stream count."""

from __future__ import annotations

import tracemalloc
from itertools import groupby

from moelane.lanes.guard import BASE_WAIT, DRAFTED, MAX_WAIT_FACTOR, PLAIN, Guard


def drive(guard: Guard, n_rounds: int, rates: dict[str, float], n_streams: int = 1) -> list[str]:
    """Run rounds that commit 1 token each at the given tokens/second per mode; the modes used, in order."""
    modes = []
    for _ in range(n_rounds):
        mode = guard.mode(n_streams)
        guard.observe(n_streams, mode, 1, 1.0 / rates[mode], measured=True)
        modes.append(mode)
    return modes


def stretches(modes: list[str]) -> list[tuple[str, int]]:
    return [(m, len(list(g))) for m, g in groupby(modes)]


def test_drafting_that_pays_runs_ever_longer_between_re_measures() -> None:
    runs = stretches(drive(Guard(), 140_000, {PLAIN: 100.0, DRAFTED: 200.0}))
    assert runs[0] == (PLAIN, 16)  # starts plain and measures it for 16 rounds
    assert runs[1] == (DRAFTED, 1 + 4 + BASE_WAIT)  # a skipped first round, 4 measured, then the run
    drafted = [n for m, n in runs[3::2]]
    factors = [1 << i for i in range(1, 7)] + [MAX_WAIT_FACTOR, MAX_WAIT_FACTOR]
    assert drafted[: len(factors)] == [BASE_WAIT * f for f in factors]  # doubles while drafted keeps winning
    assert all(run == (PLAIN, 17) for run in runs[2:-1:2])  # plain re-measured every time: skip + 16


def test_drafting_that_does_not_beat_plain_by_5_percent_is_only_re_measured() -> None:
    runs = stretches(drive(Guard(), 70_000, {PLAIN: 100.0, DRAFTED: 104.0}))
    assert runs[0] == (PLAIN, 16) and runs[1] == (DRAFTED, 5)
    assert [n for m, n in runs[2:14:2]] == [BASE_WAIT * (1 << i) for i in range(6)]
    assert all(run == (DRAFTED, 5) for run in runs[1:-1:2])  # never switched off for good


def test_winner_changes_reset_the_wait() -> None:
    guard = Guard()
    drive(guard, 16 + 5 + BASE_WAIT + 17 + 2 * BASE_WAIT, {PLAIN: 100.0, DRAFTED: 200.0})
    assert guard.entry(1).factor == 2
    modes = drive(guard, 20_000, {PLAIN: 300.0, DRAFTED: 200.0})  # drafting stops paying
    assert guard.entry(1).winner == PLAIN
    # plain re-measured (skip + 16), wins, and runs for the base wait again; then the wait doubles anew
    assert stretches(modes)[:3] == [(PLAIN, 17 + BASE_WAIT), (DRAFTED, 5), (PLAIN, 2 * BASE_WAIT)]


def test_first_round_after_a_switch_is_not_measured() -> None:
    guard = Guard()
    drive(guard, 16, {PLAIN: 100.0, DRAFTED: 200.0})
    assert guard.mode(1) == DRAFTED and guard.entry(1).n_skipped == 0
    guard.observe(1, DRAFTED, 1, 1000.0, measured=True)  # the switch round: slow, carrying plain's (lack of) drafts
    assert guard.entry(1).n_skipped == 1
    drive(guard, 4, {PLAIN: 100.0, DRAFTED: 200.0})
    assert guard.entry(1).winner == DRAFTED and guard.entry(1).running


def test_rounds_the_engine_marks_unmeasured_count_for_nothing() -> None:
    guard = Guard()
    for _ in range(40):
        guard.observe(2, PLAIN, 1, 1.0, measured=False)
    assert guard.mode(2) == PLAIN and guard.entry(2).left == 16


def test_stream_counts_are_independent() -> None:
    guard = Guard()
    drive(guard, 16, {PLAIN: 1.0, DRAFTED: 1.0}, n_streams=4)
    assert guard.modes() == {4: DRAFTED}
    assert guard.mode(5) == PLAIN


def test_one_allocation_per_stream_count() -> None:
    guard = Guard()
    drive(guard, 1, {PLAIN: 100.0, DRAFTED: 200.0}, n_streams=3)
    entry = guard.entry(3)
    tracemalloc.start()
    try:
        drive(guard, 600, {PLAIN: 100.0, DRAFTED: 200.0}, n_streams=3)  # every field now holds a computed value
        before = tracemalloc.take_snapshot()
        drive(guard, 5000, {PLAIN: 100.0, DRAFTED: 200.0}, n_streams=3)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = [d for d in after.compare_to(before, "filename") if d.traceback[0].filename.endswith("lanes/guard.py")]
    assert sum(d.size_diff for d in grown) <= 0
    assert guard.entry(3) is entry and list(guard.modes()) == [3]
