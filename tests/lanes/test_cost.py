"""Rounds priced by the bytes they read (`moelane.lanes.cost`): streams cost their distinct experts, a draft row its
share of a new stream's; calibration finds the price of a byte; the depth rule and the guard judge drafting at that
cost on a fake MoE whose clock charges every expert a pass reads."""

from __future__ import annotations

import itertools

import pytest

from moelane.lanes import Engine, EngineConfig, FakeClock
from moelane.lanes.cost import DRAFT_SHARE, ExpertPrices
from moelane.lanes.depth import Acceptance, Prices, PriceTable, Seat, allocate
from moelane.lanes.fake import FakeTarget, linear_price
from moelane.lanes.target import calibrate
from moelane.model.cache import Rows
from moelane.model.footprint import Footprint

SHAPE = Footprint(dense=1_000_000, expert=1_000_000.0, n_layers=4, n_experts=32, top_k=4)
PER_BYTE = 2e-9  # an expert of a layer: 2 ms


def flat(per_byte: float = PER_BYTE) -> ExpertPrices:
    return ExpertPrices(PriceTable([(1, 0.010), (64, 0.010 + 63 * 0.0002)]), SHAPE, per_byte)


def test_streams_cost_their_experts_and_a_draft_row_its_share_of_a_streams() -> None:
    prices = flat()
    table = prices.table
    assert prices.price(1, 1) == table.price(1)  # one row: the table's (its experts are in it)
    assert prices.price(8, 8) > prices.price(8, 1) > table.price(8)  # 8 streams read more than 1 with 7 drafts
    bytes_of = SHAPE.expected_bytes
    assert prices.price(9, 8) - prices.price(8, 8) == pytest.approx(
        table.price(9) - table.price(8) + PER_BYTE * (bytes_of(8 + DRAFT_SHARE) - bytes_of(8))
    )
    assert flat(0.0).price(8, 8) == table.price(8)


def test_a_measured_round_folds_into_the_table_net_of_its_further_bytes() -> None:
    prices = flat()
    further = PER_BYTE * (SHAPE.expected_bytes(8) - SHAPE.expected_bytes(1))
    prices.observe(8, 0.5, streams=8)
    assert prices.table.price(8) == pytest.approx(0.5 - further)
    assert prices.price(8, 8) == pytest.approx(0.5)


def brute_force(seats: list[Seat], prices: Prices, max_rows: int) -> float:
    best = 0.0
    for depths in itertools.product(*[range(s.max_drafts + 1) for s in seats]):
        rows = sum(s.base_rows for s in seats) + sum(depths)
        if rows <= max_rows:
            tokens = sum(s.acceptance.expected(d) for s, d in zip(seats, depths, strict=True))
            best = max(best, tokens / prices.price(rows, len(seats)))
    return best


@pytest.mark.parametrize("per_byte", [0.0, 1e-10, 1e-9, 1e-8])
def test_allocation_by_bytes_matches_brute_force(per_byte: float) -> None:
    prices = flat(per_byte)
    accs = [Acceptance(4) for _ in range(3)]
    accs[1].p = [0.3, 0.3, 0.3, 0.3]
    accs[2].p = [0.95, 0.9, 0.9, 0.9]
    seats = [Seat(1, True, 4, a) for a in accs]
    depths = allocate(seats, prices, 64)
    rows = 3 + sum(depths)
    tokens = sum(s.acceptance.expected(d) for s, d in zip(seats, depths, strict=True))
    assert tokens / prices.price(rows, 3) == pytest.approx(brute_force(seats, prices, 64))


def test_drafts_are_held_where_their_experts_are_cheap_beside_the_rounds() -> None:
    """One stream: the dearer a byte, the fewer drafts, none once a draft's experts cost many rounds' fixed work.
    Eight streams at that price still draft: their round reads ~20 experts a layer anyway, and a draft row adds a
    share of the few its stream's row does not."""
    one = [Seat(1, True, 8, Acceptance(8))]
    held = [sum(allocate(one, flat(per_byte), 64)) for per_byte in (0.0, 1e-9, 1e-8, 1e-7)]
    assert held == sorted(held, reverse=True) and held[0] >= 4 and held[-1] == 0
    eight = [Seat(1, True, 8, Acceptance(8)) for _ in range(8)]
    assert sum(allocate(eight, flat(1e-7), 64)) > 0


def fake(clock: FakeClock, routes: str = "token", per_byte: float = PER_BYTE, **kw: object) -> FakeTarget:
    return FakeTarget(48, window=1, clock=clock, price=linear_price(0.002, 0.0002), footprint=SHAPE,
                      per_byte=per_byte, routes=routes, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_calibration_finds_the_price_of_a_byte() -> None:
    clock = FakeClock()
    target = fake(clock)
    prices, _ = calibrate(target, None, clock, 64)
    assert isinstance(prices, ExpertPrices)
    assert prices.per_byte == pytest.approx(PER_BYTE, rel=0.25)
    cache = target.new_cache(16)
    t0 = clock.now()
    target.forward([Rows(cache, list(range(1, 9)), 0)])  # 8 rows of distinct tokens: 8 rows' experts
    assert prices.price(8, 8) == pytest.approx(clock.now() - t0, rel=0.15)
    plain, _ = calibrate(FakeTarget(48, clock=clock), None, clock, 64)
    assert isinstance(plain, PriceTable)


def guarded_choice(routes: str) -> str:
    """The guard's decision for one stream after a long reply, on a fake MoE whose every expert read costs 2 ms."""
    clock = FakeClock()
    target = fake(clock, routes)
    draft = FakeTarget(48, window=1, error_rate=0.5, clock=clock, price=linear_price(0.0002, 0.0))
    engine = Engine(target, EngineConfig(drafter="model", guard=True), draft=draft, clock=clock)
    engine.submit([1, 2, 3], max_tokens=400, stop_token_ids=None)
    engine.run_until_idle()
    assert engine.guard is not None
    entry = engine.guard.entry(1)
    assert entry.n_decisions >= 1
    return entry.winner


def test_the_guard_judges_drafting_at_the_cost_of_the_experts_its_rows_read() -> None:
    """Drafts that route as new text does read new experts (each 2 ms a layer), which half-right drafts do not pay
    for: plain wins. Drafts that route to their stream's experts read nothing new: drafting wins."""
    assert guarded_choice("token") == "plain"
    assert guarded_choice("stream") == "drafted"
