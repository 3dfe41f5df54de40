"""The depth rule: acceptance by depth, price tables, the greedy shared allocation (against brute force)."""

from __future__ import annotations

import itertools

import pytest

from moelane.lanes.depth import ACCEPT_PRIORS, ACCEPT_RATE, Acceptance, PriceTable, Seat, allocate, probe_round


def test_priors_and_update() -> None:
    a = Acceptance(8)
    assert a.p == [*ACCEPT_PRIORS, 0.5, 0.5]
    a.observe(n_offered=3, n_accepted=1)  # draft 0 landed, draft 1 did not, draft 2 was never reached
    assert a.p[0] == pytest.approx(0.85 + ACCEPT_RATE * 0.15)
    assert a.p[1] == pytest.approx(0.75 - ACCEPT_RATE * 0.75)
    assert a.p[2] == 0.7
    assert a.expected(2) == pytest.approx(1 + a.p[0] + a.p[0] * a.p[1])


def test_price_table_interpolates_and_learns() -> None:
    t = PriceTable([(1, 1.0), (9, 3.0)])
    assert t.price(1) == 1.0 and t.price(5) == pytest.approx(2.0) and t.price(17) == pytest.approx(5.0)
    t.observe(5, 4.0)
    assert t.price(5) == 4.0
    t.observe(5, 2.0)
    assert 2.0 < t.price(5) < 4.0
    with pytest.raises(ValueError):
        PriceTable([(0, 1.0)])


def brute_force(seats: list[Seat], prices: PriceTable, max_rows: int) -> float:
    """Best expected tokens per cost over every allocation (for checking the greedy one)."""
    best = 0.0
    for depths in itertools.product(*[range(s.max_drafts + 1) for s in seats]):
        rows = sum(s.base_rows for s in seats) + sum(depths)
        if rows > max_rows:
            continue
        tokens = sum(s.acceptance.expected(d) for s, d in zip(seats, depths, strict=True))
        best = max(best, tokens / prices.price(rows))
    return best


def value(seats: list[Seat], depths: list[int], prices: PriceTable) -> float:
    rows = sum(s.base_rows for s in seats) + sum(depths)
    return sum(s.acceptance.expected(d) for s, d in zip(seats, depths, strict=True)) / prices.price(rows)


@pytest.mark.parametrize("slope", [0.02, 0.1, 0.3, 1.0])
def test_allocation_matches_brute_force(slope: float) -> None:
    prices = PriceTable([(1, 1.0), (64, 1.0 + 63 * slope)])
    accs = [Acceptance(4) for _ in range(3)]
    accs[1].p = [0.3, 0.3, 0.3, 0.3]
    accs[2].p = [0.95, 0.9, 0.9, 0.9]
    seats = [Seat(1, True, 4, a) for a in accs]
    depths = allocate(seats, prices, max_rows=64, probe=False)
    assert value(seats, depths, prices) == pytest.approx(brute_force(seats, prices, 64))


def test_expensive_rows_mean_no_drafts_and_limits_hold() -> None:
    steep = PriceTable([(1, 1.0), (2, 2.0)])  # a row costs as much as a round: drafting never pays
    seats = [Seat(1, True, 8, Acceptance(8)) for _ in range(2)]
    assert allocate(seats, steep, 64, probe=False) == [0, 0]
    flat = PriceTable([(1, 1.0), (64, 1.01)])
    assert allocate(seats, flat, 64, probe=False) == [8, 8]
    assert sum(allocate(seats, flat, 6, probe=False)) == 4  # 2 base rows + 4 drafts = the row limit
    assert allocate([Seat(4, False, 8, Acceptance(8))], flat, 64) == [0]  # a prefill chunk commits nothing


def test_every_eighth_round_probes_one_deeper() -> None:
    """Every stream at once (a draft model's probe is then one draft pass every 8 rounds), a priced-out one too."""
    prices = PriceTable([(1, 1.0), (2, 1.3), (64, 30.0)])
    seats = [Seat(1, True, 8, Acceptance(8)), Seat(1, True, 8, Acceptance(8))]
    base = allocate(seats, prices, 64)
    depths = [allocate(seats, prices, 64, probe=probe_round(i)) for i in range(16)]
    assert [i for i, d in enumerate(depths) if d != base] == [7, 15]
    assert depths[7] == [d + 1 for d in base]
    assert allocate(seats, prices, 64, draft_price=100.0) == [0, 0]
    assert allocate(seats, prices, 64, draft_price=100.0, probe=True) == [1, 1]
