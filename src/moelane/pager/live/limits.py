"""The memory this process may still take: the tightest of the machine's available memory and the limits of the memory
cgroups it runs in (v1 and v2, the group's own limit and every ancestor's), and where that limit comes from.

A cgroup's usage counts the page cache its processes fill, which the kernel reclaims under pressure before it kills
anything. So the room left under a cgroup limit is the limit less the group's anonymous memory (what cannot be
reclaimed without swap), not less its whole usage; the machine's side is `MemAvailable`, which already counts
reclaimable cache as available.

Everything is read from files under `root` (the real system's `/` by default), so tests give a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 60  # v1 writes "no limit" as a huge page-rounded number (9223372036854771712 on x86-64)


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """`room`: bytes this process can still take; `limit`: the ceiling that sets it (None: only free memory);
    `source`: where it comes from, as a user reads it ("cgroup v1 /a/b", "cgroup v2 /a", "free memory")."""

    room: int
    limit: int | None
    source: str


def memory_limit(root: Path = Path("/")) -> MemoryLimit:
    """The room under the tightest limit that applies to this process (see the module docstring)."""
    free = machine_available(root)
    best = MemoryLimit(free, None, "free memory")
    for found in cgroup_limits(root):
        if found.room < best.room:
            best = found
    return best


def machine_available(root: Path) -> int:
    """`MemAvailable` of /proc/meminfo, else the free pages; a huge number when neither can be read."""
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if root == Path("/"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    return UNLIMITED


def cgroup_limits(root: Path) -> list[MemoryLimit]:
    """Each memory cgroup hierarchy's tightest limit over this process's group and its ancestors, with the room left
    under it (limit less the group's anonymous memory)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            mount = v2_mount(root)
            if mount is not None:
                found.append(walk(mount, path, "memory.max", "memory.stat", ("anon", "shmem"), "cgroup v2"))
        elif "memory" in controllers.split(","):
            mount = root / "sys/fs/cgroup/memory"
            found.append(walk(mount, path, "memory.limit_in_bytes", "memory.stat", ("total_rss", "total_shmem"),
                              "cgroup v1"))  # fmt: skip
    return [f for f in found if f.limit is not None]


def v2_mount(root: Path) -> Path | None:
    """Where the unified (v2) hierarchy is mounted: /sys/fs/cgroup itself, or /sys/fs/cgroup/unified beside v1."""
    for mount in (root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified"):
        if (mount / "cgroup.controllers").exists():
            return mount
    return None


def walk(mount: Path, path: str, limit_file: str, stat_file: str, anon_keys: tuple[str, ...], kind: str) -> MemoryLimit:
    """The tightest `limit_file` from the group at `path` up to the hierarchy's root; the room under it is the limit
    less the anonymous bytes of the group that sets it (`stat_file`'s `anon_keys`, counted over its descendants)."""
    group = mount / path.lstrip("/")
    best: MemoryLimit | None = None
    while True:
        limit = read_limit(group / limit_file)
        if limit is not None:
            anon = sum(read_stat(group / stat_file).get(key, 0) for key in anon_keys)
            rel = group.relative_to(mount).as_posix()
            here = MemoryLimit(max(limit - anon, 0), limit, f"{kind} /{'' if rel == '.' else rel}")
            if best is None or here.room < best.room:
                best = here
        if group == mount or mount not in group.parents:
            break
        group = group.parent
    return best or MemoryLimit(UNLIMITED, None, kind)


def read_limit(path: Path) -> int | None:
    """A limit file's bytes; None for no limit ("max", v1's huge number) or an unreadable file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= UNLIMITED:
        return None
    return int(text)


def read_stat(path: Path) -> dict[str, int]:
    """A memory.stat file as {key: bytes}."""
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """This process's resident memory: `anon` (its heap, anonymous mappings and shared memory: counted against a
    cgroup's room already) and `file` (mapped files' pages: its code and libraries, which it keeps touching)."""

    anon: int
    file: int


def process_memory(root: Path = Path("/")) -> ProcessMemory:
    """RssAnon + RssShmem and RssFile of /proc/self/status (zeros where it cannot be read)."""
    fields: dict[str, int] = {}
    try:
        for line in (root / "proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return ProcessMemory(fields.get("RssAnon", 0) + fields.get("RssShmem", 0), fields.get("RssFile", 0))
