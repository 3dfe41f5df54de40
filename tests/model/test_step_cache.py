"""The compiled decode steps' cache keeps the most recently used libraries (`moelane.model.exported.prune`)."""

from __future__ import annotations

import os
from pathlib import Path

from moelane.model.exported import prune, touch


def library(folder: Path, name: str, age_s: int) -> Path:
    path = folder / f"{name}.pt2"
    path.write_bytes(b"library")
    then = 1_700_000_000 - age_s
    os.utime(path, (then, then))
    return path


def test_prune_keeps_the_most_recently_used_libraries(tmp_path: Path) -> None:
    paths = [library(tmp_path, f"step{i}", age_s=100 * i) for i in range(6)]  # step0 the newest
    other = tmp_path / "notes.txt"
    other.write_text("not a library")
    touch(paths[5])  # the oldest, used just now
    prune(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step0.pt2", "step1.pt2", "step5.pt2"]
    assert other.read_text() == "not a library"


def test_prune_of_a_missing_folder_or_few_libraries_changes_nothing(tmp_path: Path) -> None:
    prune(tmp_path / "missing", 2)
    paths = [library(tmp_path, f"step{i}", age_s=i) for i in range(2)]
    prune(tmp_path, 2)
    assert all(p.is_file() for p in paths)
