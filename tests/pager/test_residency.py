"""The slot table's residency view (what a dashboard samples): per key, the tier it is held at or -1, the plan's pins,
and use counts; copies, so the table moving on does not change a view already taken."""

from __future__ import annotations

import numpy as np

from moelane.pager.live.slots import SlotTable


def test_residency_is_a_copy_of_the_per_key_view() -> None:
    table = SlotTable(n_slots=3, n_keys=6, policy="planner", default_tier=0)
    credit, hard, tier = np.zeros(6, np.int64), np.zeros(6, bool), np.zeros(6, np.int8)
    credit[1], hard[4], tier[4] = 8, True, 2
    table.set_plan(credit, hard, tier)
    table.assign(0, 1, 0)
    table.assign(1, 4, 0)
    table.touch(np.array([1, 4]))
    table.touch(np.array([4]))
    view = table.residency()
    assert view.tier.tolist() == [-1, 0, -1, -1, 2, -1]
    assert view.pinned.tolist() == [False, True, False, False, True, False]
    assert view.hard.tolist() == [False, False, False, False, True, False]
    assert view.count.tolist() == [0, 1, 0, 0, 2, 0]
    table.lease[:] = 0
    table.state[:] = 2
    table.assign(0, 5, 0)  # key 1 evicted after the view was taken
    table.touch(np.array([5]))
    assert view.tier[1] == 0 and view.count[5] == 0
    assert table.residency().tier.tolist() == [-1, -1, -1, -1, 2, 0]
