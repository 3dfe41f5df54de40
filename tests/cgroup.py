"""A fresh memory cgroup with a limit, for tests and benchmarks that run a process under a kernel-enforced ceiling.

Made as a child of this process's own memory cgroup where that is writable (it stays inside whatever holds this
process), else of the hierarchy's root; v1 (`memory.limit_in_bytes`, `memory.max_usage_in_bytes`, `memory.failcnt`,
`memory.oom_control`'s `oom_kill`) or v2 (`memory.max`, `memory.peak`, `memory.events`). Needs root.
`MemoryGroup.create` returns None, with the reason in `why_not()`, where no group can be made here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class GroupUsage:
    """What the kernel counted for a group: its peak usage (page cache included), how often usage hit the limit
    (v1 failcnt; v2's `max` events), and OOM kills in it."""

    peak: int
    failcnt: int
    oom_kills: int


def own_path(controller_line: str) -> str | None:
    """This process's group in /proc/self/cgroup for a line matching `controller_line` ("memory", or "" for v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller_line and controller_line in controllers.split(",")) or (not controller_line and not controllers):
            return path
    return None


def parents() -> list[tuple[Path, str]]:
    """Where a group may be made, best first, with its version: this process's own group, then the root."""
    out: list[tuple[Path, str]] = []
    if (V1 / "memory.limit_in_bytes").exists():
        own = own_path("memory")
        if own is not None:
            out.append((V1 / own.lstrip("/"), "v1"))
        out.append((V1, "v1"))
    elif "memory" in (V2 / "cgroup.controllers").read_text().split() if (V2 / "cgroup.controllers").exists() else ():
        own = own_path("")
        if own is not None and own != "/":
            out.append((V2 / own.lstrip("/"), "v2"))
        out.append((V2, "v2"))
    return out


def why_not() -> str | None:
    """Why no memory cgroup can be made here (None: one can)."""
    if os.geteuid() != 0:
        return "making a memory cgroup needs root"
    if not parents():
        return "no cgroup v1 memory controller or v2 memory controller is mounted at /sys/fs/cgroup"
    group = MemoryGroup.create(1 << 30)
    if group is None:
        return "no memory cgroup could be made under this process's own or the root group"
    group.remove()
    return None


class MemoryGroup:
    """A memory cgroup with a hard limit; `spawn` runs a command inside it."""

    def __init__(self, path: Path, version: str) -> None:
        self.path, self.version = path, version

    @classmethod
    def create(cls, limit: int, prefix: str = "moelane") -> MemoryGroup | None:
        for parent, version in parents():
            path = parent / f"{prefix}-{uuid.uuid4().hex[:10]}"
            try:
                path.mkdir()
            except OSError:
                continue
            group = cls(path, version)
            try:
                group.set_limit(limit)
            except OSError:
                group.remove()
                continue
            return group
        return None

    def set_limit(self, limit: int) -> None:
        if self.version == "v1":
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            with contextlib.suppress(OSError):  # (no swap accounting: nothing to limit)
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        else:
            (self.path / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")

    def join(self) -> None:
        """Move the calling process into the group (a `preexec_fn`: the child joins before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def spawn(self, argv: list[str], **kwargs: object) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, preexec_fn=self.join, text=True, **kwargs)  # type: ignore[call-overload]

    def usage(self) -> GroupUsage:
        if self.version == "v1":
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            return GroupUsage(int((self.path / "memory.max_usage_in_bytes").read_text()),
                              int((self.path / "memory.failcnt").read_text()), int(oom.get("oom_kill", 0)))  # fmt: skip
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        peak = self.path / "memory.peak"
        return GroupUsage(int(peak.read_text()) if peak.exists() else 0, int(events.get("max", 0)),
                          int(events.get("oom_kill", 0)))  # fmt: skip

    def remove(self) -> None:
        """Remove the group once its processes have exited (retried briefly: an exiting process leaves late)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache() -> None:
    """Write back dirty pages and drop the clean page cache (root)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
