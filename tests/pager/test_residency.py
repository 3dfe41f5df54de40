"""The slot table's residency view (what a dashboard samples): per key, the tier it is held at or -1, the plan's pins,
and use counts; copies, so the table moving on does not change a view already taken."""

from __future__ import annotations

import numpy as np

from moelane.pager.live.slots import SlotTable


def test_residency_is_a_copy_of_the_per_key_view() -> None:
    table = SlotTable(capacity=[2, 2, 2], tier_bytes=[4, 2, 1], budget=7, n_keys=6, policy="planner", default_tier=0)
    for tier in range(3):
        table.use_tier(tier)
    table.set_plan([(4, 2)], default_tier=0, credit=8, hard=True)  # key 4 planned at int4, hard-pinned
    none = np.zeros(0, np.int64)
    for key in (1, 4):
        admission = table.admit(np.array([key]), none)
        assert admission is not None
        table.loaded(admission.slots[0])
    table.touch(np.array([1, 4]))
    table.touch(np.array([4]))
    view = table.residency()
    assert view.tier.tolist() == [-1, 0, -1, -1, 2, -1]
    assert view.pinned.tolist() == [False, False, False, False, True, False]
    assert view.hard.tolist() == [False, False, False, False, True, False]
    assert view.count.tolist() == [0, 1, 0, 0, 2, 0]
    table.lease[:] = 0
    admission = table.admit(np.array([5]), none)  # 4 + 1 + 4 bytes > 7: key 1 is evicted after the view was taken
    assert admission is not None and admission.evicted == [(1, 0)]
    table.loaded(admission.slots[0])
    table.touch(np.array([5]))
    assert view.tier[1] == 0 and view.count[5] == 0
    assert table.residency().tier.tolist() == [-1, -1, -1, -1, 2, 0]
