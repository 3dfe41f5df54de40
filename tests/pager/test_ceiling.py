"""moelane honours the memory limit it runs under (`pager.live.ceiling`): `moelane run` in a real memory cgroup at
the minimum it reports gives the unlimited run's greedy tokens, its expert budget follows the group's limit, and
below the minimum it refuses in one line with exit code 2. These run as root where a v1 or v2 memory cgroup can be
made (tests/cgroup.py), and are skipped with the reason elsewhere. Reads that bypass the page cache are checked
against plain reads everywhere."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moelane.pager.live.limits import MemoryLimit, ProcessMemory
from moelane.pager.live.memory import parse_memory
from moelane.pager.live.uncached import BLOCK, CHUNK, Bounce, UncachedFile
from tests import cgroup

MiB = 1 << 20
RUN = [sys.executable, "-m", "moelane", "run", "--max-tokens", "12", "--drafter", "none", "--compile", "off",
       "--stats", "def fibonacci(n):"]  # fmt: skip
WHY_NOT = cgroup.why_not()
needs_cgroup = pytest.mark.skipif(WHY_NOT is not None, reason=f"no memory cgroup: {WHY_NOT}")


def run_in(limit: int | None) -> subprocess.CompletedProcess[str]:
    """`moelane run` on the shipped model, in a fresh memory cgroup of `limit` bytes (None: as this process runs)."""
    if limit is None:
        return subprocess.run(RUN, capture_output=True, text=True, timeout=120)
    group = cgroup.MemoryGroup.create(limit, "moelane-test")
    assert group is not None
    try:
        proc = group.spawn(RUN, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
        assert group.usage().oom_kills == 0, err
        return subprocess.CompletedProcess(RUN, proc.returncode, out, err)
    finally:
        group.remove()


def reported(err: str, name: str) -> int:
    """A size from the `--stats` memory line ("needs a limit of at least 431.2 MiB", "expert budget 5.2 MiB")."""
    found = re.search(rf"{name} (\d+(?:\.\d+)? [KMG]i?B)", err)
    assert found, err
    return parse_memory(found.group(1).replace(" ", "")).resolve(0)


@pytest.fixture(scope="module")
def unlimited() -> subprocess.CompletedProcess[str]:
    done = run_in(None)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow  # (~5 s; the fast set keeps the refusal below the minimum)
@needs_cgroup
def test_at_the_minimum_it_pages_to_the_same_tokens_and_its_budget_follows_the_limit(
    unlimited: subprocess.CompletedProcess[str],
) -> None:
    minimum = reported(unlimited.stderr, "at least")
    # (the minimum counts this process's memory before any weight, which varies by a few MiB from run to run)
    low, high = run_in(minimum + 8 * MiB), run_in(minimum + 24 * MiB)  # (all experts take 40.5 MiB)
    for done in (low, high):
        assert done.returncode == 0, done.stderr
        assert done.stdout == unlimited.stdout
        assert "(paged)" in done.stderr and "cgroup v" in done.stderr and "disk per decode token" in done.stderr
    grown = reported(high.stderr, "expert budget") - reported(low.stderr, "expert budget")
    assert abs(grown - 16 * MiB) < 6 * MiB, (low.stderr, high.stderr)


@needs_cgroup
def test_below_the_minimum_it_refuses_in_one_line_naming_it(unlimited: subprocess.CompletedProcess[str]) -> None:
    minimum = reported(unlimited.stderr, "at least")
    done = run_in(minimum - 40 * MiB)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs at least" in lines[0] and "cgroup v" in lines[0], done.stderr
    assert abs(reported(lines[0], "the") - minimum) < 8 * MiB  # ("below the 431.2 MiB this model needs at least")


def test_the_budget_is_the_room_less_mapped_files_and_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a limit the whole room is the experts' but for the process's mapped files and the reserve; under free
    memory alone, `HEADROOM` of it is left to the machine's other processes."""
    from moelane.pager.live import ceiling

    monkeypatch.setattr(ceiling, "process_memory", lambda: ProcessMemory(100 * MiB, 30 * MiB))
    free = int(1000 * MiB * (1 - ceiling.HEADROOM))
    for found, want in ((MemoryLimit(1000 * MiB, 2000 * MiB, "cgroup v2 /a"), 1000 * MiB),
                        (MemoryLimit(1000 * MiB, None, "free memory"), free)):  # fmt: skip
        monkeypatch.setattr(ceiling, "memory_limit", lambda found=found: found)
        limit = ceiling.Ceiling()
        assert limit.budget(1 << 40) == want - 30 * MiB - ceiling.WORK_BYTES
        assert limit.report.source == found.source and not limit.report.resident


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_uncached_reads_equal_plain_reads(tmp_path: Path, where: str) -> None:
    """Any offset and length, across chunks, several views: the bytes a plain read gives (direct or buffered)."""
    folder = Path("/dev/shm") if where == "shm" and Path("/dev/shm").is_dir() else tmp_path
    path = folder / f"moelane-uncached-{os.getpid()}.bin"
    rng = random.Random(0)
    data = rng.randbytes(CHUNK + 5 * BLOCK + 123)
    path.write_bytes(data)
    try:
        f = UncachedFile(str(path), Bounce())
        for offset, length in [(0, len(data)), (1, BLOCK), (BLOCK - 1, 2), (777, CHUNK + 1)] + [
            (rng.randrange(len(data)), rng.randrange(1, CHUNK + 3 * BLOCK)) for _ in range(20)
        ]:
            cut = length // 3
            bufs = [bytearray(cut), bytearray(length - cut)]
            got = f.pread([memoryview(b) for b in bufs], offset)
            want = data[offset : offset + length]
            assert got == len(want) and (bytes(bufs[0]) + bytes(bufs[1]))[:got] == want
        f.use_buffered()  # (the fallback: buffered reads, then DONTNEED)
        buf = bytearray(1000)
        assert f.pread([memoryview(buf)], 4097) == 1000 and bytes(buf) == data[4097:5097]
        f.close()
    finally:
        path.unlink()
