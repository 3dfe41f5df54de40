import json
from pathlib import Path

import pytest

from moelane.pager.plan import Plan


def test_json_roundtrip_and_documented_form(tmp_path: Path) -> None:
    plan = Plan(1 << 30, 4, ((0, 3, None), (2, 7, 1)), default_tier=2, pin_mode="hard", warm=((1, 1), (0, 3)))
    assert Plan.from_json(plan.to_json()) == plan
    body = json.loads(plan.to_json())
    assert body == {
        "version": 1,
        "budget_bytes": 1 << 30,
        "window_k": 4,
        "default_tier": 2,
        "pin_mode": "hard",
        "pins": [[0, 3, None], [2, 7, 1]],
        "warm": [[1, 1], [0, 3]],
    }
    path = tmp_path / "plan.json"
    plan.write_atomic(path)
    assert Plan.from_json(path.read_text()) == plan
    Plan(5, 1).write_atomic(path)  # replaces it whole, leaves no temporary behind
    assert Plan.from_json(path.read_text()) == Plan(5, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget_bytes": 0, "window_k": 1},
        {"budget_bytes": 1, "window_k": 0},
        {"budget_bytes": 1, "window_k": 1, "pins": ((0, 1, None), (0, 1, 2))},
        {"budget_bytes": 1, "window_k": 1, "pin_mode": "soft"},
        {"budget_bytes": 1, "window_k": 1, "default_tier": -1},
    ],
)
def test_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Plan(**kwargs)  # type: ignore[arg-type]


def test_same_residency_ignores_window_and_warm() -> None:
    a = Plan(10, 2, ((0, 1, None),), warm=((0, 1),))
    assert a.same_residency(Plan(10, 3, ((0, 1, None),)))
    assert not a.same_residency(Plan(10, 2, ((0, 2, None),)))
    assert not a.same_residency(Plan(11, 2, ((0, 1, None),)))
    assert not a.same_residency(None)
