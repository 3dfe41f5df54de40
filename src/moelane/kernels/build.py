"""Compiles the C++ kernels (csrc/) on first use and caches the binary per source, torch, compiler and CPU.

    key = sha256(sources, torch and Python versions, compiler version, CPU ISA flags, compile flags)
    dir = $XDG_CACHE_HOME/moelane/kernels/<key>/    (~/.cache when XDG_CACHE_HOME is unset)
    under an fcntl lock on dir/build.lock: import dir/<name>.so if dir/ready exists, else build it, then write ready

A changed CPU or source gives another key, so a stale binary is never loaded. Processes that build the same key at
once take turns on the lock: the first builds, the others then find `ready` and only import. A build killed midway
leaves no `ready`, so the next process builds again (torch's own lock file, left behind by such a kill, is removed
first: only the holder of build.lock builds in that directory).

Nothing happens at import. The compiler is `$CXX` or `c++` (as torch.utils.cpp_extension uses); ninja comes from the
`ninja` package, put on PATH for the build only. Failures raise `BuildError` with the reason in one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("gather_linear.cpp", "attention.cpp")
COMPILE_MESSAGE = "compiling moelane's CPU kernels (once, 10-20 s)"
# -ffp-contract=off: no multiply-add fused behind our back (the tiles spell out every FMA); no -ffast-math.
FLAGS = {
    "native": ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
    "avx2": ["-O3", "-march=native", "-mno-avx512f", "-ffp-contract=off", "-fopenmp"],  # tests: the AVX2 tiles
    "generic": ["-O3", "-march=native", "-mno-avx512f", "-mno-avx2", "-ffp-contract=off", "-fopenmp"],  # portable
    "no-vnni": ["-O3", "-march=native", "-mno-avx512vnni", "-ffp-contract=off", "-fopenmp"],  # tests: int8 by pmaddwd
}
_lock = threading.Lock()


class BuildError(RuntimeError):
    """The extension could not be built or loaded (no compiler, no ninja, a compile error); one line."""


def user_cache(name: str) -> Path:
    """moelane's folder `name` in the user's cache: $XDG_CACHE_HOME/moelane/<name>, ~/.cache where it is unset (the
    kernels here, and the model's compiled steps and tier files)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moelane" / name


def cache_root() -> Path:
    return user_cache("kernels")


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _compiler_version() -> str:
    cxx = _compiler()
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except OSError:
        return f"{cxx}: not found"
    return f"{cxx}: {out.splitlines()[0] if out else '?'}"


def _cpuinfo(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line named one of `names` (the first CPU's); None where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in names:
                return value.strip()
    return None


def _cpu_flags() -> str:
    """The CPU's ISA flags (x86 `flags`, Arm `Features`), sorted; the machine name where /proc/cpuinfo is missing."""
    found = _cpuinfo("flags", "Features")
    return " ".join(sorted(found.split())) if found is not None else platform.machine()


def _cpu_vendor() -> str:
    """The x86 `vendor_id` (GenuineIntel, AuthenticAMD); "" where there is none."""
    return _cpuinfo("vendor_id") or ""


def flags(variant: str = "native") -> list[str]:
    """The compile flags of `variant` on this CPU: FLAGS[variant], and MOELANE_NO_PREFETCH on AMD CPUs with AVX-512
    (Zen 4 on), whose hardware prefetcher streams the weights without most of the tiles' prefetches (csrc/prefetch.h;
    one MoE layer streamed from memory at 2 threads, 1.05-1.29x without them, the same bits: docs/kernels.md). On the
    Xeon they had gained 3-19%; a CPU with AVX2 only keeps them (not measured without)."""
    amd_avx512 = _cpu_vendor() == "AuthenticAMD" and "avx512f" in _cpu_flags().split()
    return FLAGS[variant] + (["-DMOELANE_NO_PREFETCH"] if amd_avx512 else [])


def build_key(variant: str = "native") -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    parts = [torch.__version__, sys.implementation.cache_tag, _compiler_version(), _cpu_flags(), *flags(variant)]
    h.update("\0".join(parts).encode())
    return h.hexdigest()[:20]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """PATH with the `ninja` package's binary first, for this build (torch runs `ninja` by name)."""
    try:
        import ninja
    except ImportError:
        yield  # maybe a system ninja; torch says so if not
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _import(name: str, path: Path) -> ModuleType:
    """The built library's operators, torch.ops.<name> (gather_linear, attend_cache, quantise_rows, register_cpu,
    isa: csrc/gather_linear.cpp), loaded into this process (again: a no-op)."""
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    ops: ModuleType = getattr(torch.ops, name)
    return ops


def _compile(name: str, folder: Path, variant: str, csrc: Path = CSRC) -> ModuleType:
    """Build the library from the sources in `csrc` (this package's, or another revision's copy) into `folder`, and
    load it (`_import`). A library of operators, not a Python module: no pybind11, whose headers alone took ~20 s
    a source file to compile."""
    from torch.utils import cpp_extension

    (folder / "lock").unlink(missing_ok=True)  # torch's baton, stale if a build was killed; we hold build.lock
    with _ninja_on_path():
        cpp_extension.load(
            name=name,
            sources=[str(csrc / s) for s in SOURCES],
            extra_cflags=flags(variant),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(csrc)],
            build_directory=str(folder),
            verbose=False,
            is_python_module=False,
        )
    return _import(name, folder / f"{name}.so")


def load(variant: str = "native", on_compile: Callable[[str], None] | None = None) -> ModuleType:
    """The compiled extension, built first if this key has no finished build. `on_compile(message)` is called just
    before a compile starts (the CLI shows it); the message is also logged at INFO. Raises `BuildError`."""
    key = build_key(variant)
    name = f"moelane_kernels_{key}"
    folder = cache_root() / key
    with _lock:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _file_lock(folder / "build.lock"):
                if (folder / "ready").exists():
                    return _import(name, folder / f"{name}.so")
                if shutil.which(_compiler()) is None:
                    raise BuildError(f"no C++ compiler: {_compiler()} not found (set CXX or install g++)")
                log.info(COMPILE_MESSAGE)
                if on_compile is not None:
                    on_compile(COMPILE_MESSAGE)
                module = _compile(name, folder, variant)
                (folder / "ready").write_text(key + "\n")
                return module
        except BuildError:
            raise
        except Exception as e:  # the build's own errors come as RuntimeError, OSError, ImportError, ...
            raise BuildError(one_line(e)) from e


def one_line(e: BaseException) -> str:
    """An exception's message in one line: a compiler's first `error:` line, else a `not found` line, else the
    first line (torch's build errors start with the whole compile command)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for marker in ("error:", "not found"):
        found = [line for line in lines if marker in line]
        if found:
            return f"{type(e).__name__}: {found[0]}"[:400]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]
