"""The memory limit a process runs under (`moelane.pager.live.limits`): free memory, cgroup v1 and v2 limits of the
process's group and its ancestors, the room under them net of anonymous memory; and a real cgroup where the tests run
as root on a machine that has cgroup v1's memory controller."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moelane.pager.live.limits import memory_limit

GiB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def meminfo(root: Path, available: int) -> None:
    write(root / "proc/meminfo", f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")


def test_without_cgroups_the_room_is_free_memory(tmp_path: Path) -> None:
    meminfo(tmp_path, 8 * GiB)
    found = memory_limit(tmp_path)
    assert (found.room, found.limit, found.source) == (8 * GiB, None, "free memory")


def test_a_v1_limit_of_an_ancestor_counts_and_the_room_is_net_of_anonymous_memory(tmp_path: Path) -> None:
    meminfo(tmp_path, 16 * GiB)
    write(tmp_path / "proc/self/cgroup", "5:cpu:/\n4:memory:/box/job\n0::/\n")
    v1 = tmp_path / "sys/fs/cgroup/memory"
    write(v1 / "memory.limit_in_bytes", "9223372036854771712\n")  # the root: no limit
    write(v1 / "box/memory.limit_in_bytes", str(2 * GiB))
    write(v1 / "box/memory.stat", f"total_cache {GiB}\ntotal_rss {GiB // 2}\ntotal_shmem 0\n")
    write(v1 / "box/job/memory.limit_in_bytes", "9223372036854771712\n")
    write(v1 / "box/job/memory.stat", f"total_rss {GiB // 4}\n")
    found = memory_limit(tmp_path)
    assert (found.room, found.limit, found.source) == (2 * GiB - GiB // 2, 2 * GiB, "cgroup v1 /box")


def test_a_v2_limit_applies_and_the_tightest_of_several_wins(tmp_path: Path) -> None:
    meminfo(tmp_path, 16 * GiB)
    write(tmp_path / "proc/self/cgroup", "0::/user/app\n")
    v2 = tmp_path / "sys/fs/cgroup"
    write(v2 / "cgroup.controllers", "memory cpu\n")
    write(v2 / "user/memory.max", str(4 * GiB))
    write(v2 / "user/memory.stat", f"anon {GiB}\nfile {2 * GiB}\n")
    write(v2 / "user/app/memory.max", str(3 * GiB))
    write(v2 / "user/app/memory.stat", f"anon {GiB // 2}\nshmem 0\n")
    found = memory_limit(tmp_path)
    assert (found.room, found.limit, found.source) == (3 * GiB - GiB // 2, 3 * GiB, "cgroup v2 /user/app")
    meminfo(tmp_path, GiB)  # free memory tighter than any limit
    assert memory_limit(tmp_path).source == "free memory"


def test_max_means_no_limit(tmp_path: Path) -> None:
    meminfo(tmp_path, 8 * GiB)
    write(tmp_path / "proc/self/cgroup", "0::/\n")
    write(tmp_path / "sys/fs/cgroup/cgroup.controllers", "memory\n")
    write(tmp_path / "sys/fs/cgroup/memory.max", "max\n")
    assert memory_limit(tmp_path).source == "free memory"


V1 = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(
    not (V1 / "cgroup.procs").exists() or os.geteuid() != 0, reason="needs root and cgroup v1's memory controller"
)
def test_a_real_cgroup_limit_is_found_by_a_process_inside_it() -> None:
    group = V1 / f"moelane-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(3 * GiB))
        code = "from moelane.pager.live.limits import memory_limit as m; f = m(); print(f.limit, f.source)"
        run = f"echo $$ > {group}/cgroup.procs && exec {sys.executable} -c '{code}'"
        done = subprocess.run(["bash", "-c", run], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        limit, source = done.stdout.split(maxsplit=1)
        assert int(limit) == 3 * GiB and source.strip() == f"cgroup v1 /{group.relative_to(V1)}"
    finally:
        group.rmdir()
