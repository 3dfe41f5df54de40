"""Memory sizes as users write them: `512MiB`, `2GiB`, `1.5GB`, `300000000`, or a share such as `25%`.

A `MemorySpec` is either an absolute byte count or a fraction of some whole (for `--expert-memory`, all expert bytes
in the compute dtype; for `--host-memory`, all expert bytes as stored on disk); `resolve(total)` turns it into bytes.
Binary suffixes (KiB, MiB, GiB, TiB, and the bare K, M, G, T) are powers of 1024; decimal ones (KB, MB, GB, TB) are
powers of 1000. Parsing is strict: anything else raises `ValueError` with the text that failed. A size is parsed once,
where the user gives it (the command line's flags, `moelane.load`'s arguments), and passed on as a `MemorySpec`, which
keeps the text it was parsed from for messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_SHARE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """`n_bytes` when absolute, else `fraction` of a whole (exactly one of them is set); `text`: as the user wrote it
    (None when made in code), which is how messages show it."""

    n_bytes: int | None = None
    fraction: float | None = None
    text: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if (self.n_bytes is None) == (self.fraction is None):
            raise ValueError("a memory spec is either a byte count or a fraction, not both or neither")
        if self.n_bytes is not None and self.n_bytes < 0:
            raise ValueError(f"memory size must be >= 0 bytes, got {self.n_bytes}")
        if self.fraction is not None and not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"memory share must be between 0% and 100%, got {self.fraction * 100:g}%")

    def resolve(self, total: int) -> int:
        """Bytes this spec means when the whole is `total` bytes (a share is rounded down)."""
        if self.n_bytes is not None:
            return self.n_bytes
        assert self.fraction is not None
        return int(self.fraction * total)

    def __str__(self) -> str:
        if self.text is not None:
            return self.text
        return f"{self.fraction * 100:g}%" if self.fraction is not None else format_bytes(self.n_bytes or 0)


def parse_memory(text: str) -> MemorySpec:
    """`"512MiB"` -> 536870912 bytes; `"25%"` -> a quarter of the whole."""
    share = _SHARE.match(text)
    if share:
        return MemorySpec(fraction=float(share.group(1)) / 100.0, text=text)
    size = _SIZE.match(text)
    if not size or size.group(2).lower() not in UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GiB, 1.5GB, 300000000 or 25%)")
    return MemorySpec(n_bytes=int(float(size.group(1)) * UNITS[size.group(2).lower()]), text=text)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")
