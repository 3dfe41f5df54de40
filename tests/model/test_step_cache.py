"""The compiled decode steps' cache keeps the most recently used libraries (`moelane.model.exported.prune`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from moelane.model.exported import prune, touch

DAY = 24 * 3600


def library(folder: Path, name: str, age_s: float) -> Path:
    path = folder / f"{name}.pt2"
    path.write_bytes(b"library")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_prune_keeps_the_most_recently_used_libraries(tmp_path: Path) -> None:
    paths = [library(tmp_path, f"step{i}", age_s=10 * DAY + 100 * i) for i in range(6)]  # step0 the newest
    other = tmp_path / "notes.txt"
    other.write_text("not a library")
    touch(paths[5])  # the oldest, used just now
    prune(tmp_path, 3, DAY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step0.pt2", "step1.pt2", "step5.pt2"]
    assert other.read_text() == "not a library"


def test_prune_of_a_missing_folder_or_few_libraries_changes_nothing(tmp_path: Path) -> None:
    prune(tmp_path / "missing", 2, DAY)
    paths = [library(tmp_path, f"step{i}", age_s=10 * DAY + i) for i in range(2)]
    prune(tmp_path, 2, DAY)
    assert all(p.is_file() for p in paths)


def test_prune_spares_libraries_used_recently_beyond_the_count(tmp_path: Path) -> None:
    """A run that compiles many libraries at once (a test suite) keeps them all."""
    recent = [library(tmp_path, f"recent{i}", age_s=60 * i) for i in range(5)]
    old = library(tmp_path, "old", age_s=10 * DAY)
    prune(tmp_path, 2, DAY)
    assert all(p.is_file() for p in recent) and not old.exists()
