"""`Stream.subscribe`: a listener sees every committed token once and in order, then the end, however late it joins;
a failing listener never reaches the engine."""

from __future__ import annotations

import threading

import pytest

from moelane.lanes.stream import Stream


def test_listener_sees_every_token_in_order_then_the_end() -> None:
    stream = Stream(0, [1, 2], 100)
    stream._append([5, 6])
    seen: list[list[int] | None] = []
    stream.subscribe(seen.append)
    assert seen == [[5, 6]]

    def engine() -> None:
        for t in range(7, 60):
            stream._append([t])
        stream._finish("length")
        stream._finish("cancelled")  # a second finish changes nothing

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    assert [t for batch in seen[:-1] for t in batch or []] == list(range(5, 60))
    assert seen[-1] is None and seen.count(None) == 1
    late: list[list[int] | None] = []
    stream.subscribe(late.append)
    assert late == [list(range(5, 60)), None]


def test_a_failing_listener_does_not_reach_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    """What a listener raises is logged (a RuntimeError too: a closed event loop, or a bug) and goes no further."""
    stream = Stream(0, [1], 10)

    def closed_loop(_: list[int] | None) -> None:
        raise RuntimeError("Event loop is closed")

    def buggy(_: list[int] | None) -> None:
        raise ValueError("bug")

    stream.subscribe(closed_loop)
    stream.subscribe(buggy)
    with caplog.at_level("ERROR", logger="moelane.lanes.stream"):
        stream._append([3])
        stream._finish("stop")
    assert stream.token_ids == [3] and stream.finish_reason == "stop"
    raised = [r.exc_info[0] for r in caplog.records if r.message == "a stream listener failed" and r.exc_info]
    assert raised == [RuntimeError, ValueError, RuntimeError, ValueError]
