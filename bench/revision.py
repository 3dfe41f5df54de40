"""The revision a benchmark measured, for its JSON lines.

That is the tree its `moelane` is imported from, which need not be the one the script lives in or the current
directory (`PYTHONPATH=<worktree>/src python bench/x.py` measures the worktree): its short commit, with `+dirty` where
tracked files differ from that commit, or "unknown" where `moelane` does not come from a git checkout (an installed
wheel). Found without importing `moelane` (a benchmark of a server in a subprocess need not load it). A script whose
workers import `moelane` from its own tree (`ROOT / "src"` put first) passes that tree. Asked once per process: a
run's lines all carry the revision it started on.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
from pathlib import Path


@functools.cache
def git_rev(tree: Path | None = None) -> str:
    if tree is not None:
        where = tree
    elif (spec := importlib.util.find_spec("moelane")) is not None and spec.origin:
        where = Path(spec.origin).parent
    else:
        where = Path(__file__).parent
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if changed else head
