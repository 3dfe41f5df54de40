"""Building and caching the extension: the cache directory and key, concurrent first uses taking turns on the lock,
a failed build falling back (reported by `available()`, warned once), and the portable tiles (slow: a second build)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moelane import kernels
from moelane.kernels import build, op
from tests.kernels.helpers import random_pool, reference

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, env: dict[str, str] | None = None, *args: str) -> subprocess.Popen[str]:
    import os

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=full_env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_root() == tmp_path / "moelane" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert build.cache_root() == tmp_path / "home" / ".cache" / "moelane" / "kernels"


def test_key_changes_with_source_cpu_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = build.build_key()
    assert key == build.build_key() and key != build.build_key("generic")
    monkeypatch.setattr(build, "_cpu_flags", lambda: "sse2 avx2")
    assert build.build_key() != key
    monkeypatch.undo()
    for f in build.CSRC.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "CSRC", tmp_path)
    assert build.build_key() == key
    with (tmp_path / "tiles_generic.h").open("a") as f:
        f.write("// changed\n")
    assert build.build_key() != key


@pytest.mark.parametrize(
    ("vendor", "cpu", "prefetch"),
    [("AuthenticAMD", "avx2 avx512f fma", False), ("AuthenticAMD", "avx2 fma", True),
     ("GenuineIntel", "avx2 avx512f fma", True)],
)  # fmt: skip
def test_only_amd_cpus_with_avx512_drop_the_prefetches(
    monkeypatch: pytest.MonkeyPatch, vendor: str, cpu: str, prefetch: bool
) -> None:
    """Zen 4 on (AMD with AVX-512) builds without the tiles' software prefetches (csrc/prefetch.h), every variant;
    the others keep them; the choice is part of the key."""
    monkeypatch.setattr(build, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(build, "_cpu_flags", lambda: cpu)
    for variant in build.FLAGS:
        assert ("-DMOELANE_NO_PREFETCH" not in build.flags(variant)) == prefetch
        assert build.flags(variant)[: len(build.FLAGS[variant])] == build.FLAGS[variant]
    key = build.build_key()
    monkeypatch.setattr(build, "_cpu_vendor", lambda: "AuthenticAMD" if vendor != "AuthenticAMD" else "GenuineIntel")
    assert (build.build_key() == key) == ("avx512f" not in cpu)


FAKE_BUILD = """
    import sys, time, types
    from pathlib import Path
    from moelane.kernels import build

    def note(what):
        with Path(sys.argv[1]).open("a") as f:
            f.write(f"{what} {time.time()}\\n")

    def compile_(name, folder, variant):
        note("start")
        time.sleep(1.0)
        note("end")
        return types.ModuleType(name)

    def import_(name, path):
        note("import")
        return types.ModuleType(name)

    build._compile, build._import = compile_, import_
    build.load()
"""


@pytest.mark.slow  # (real builds in subprocesses: ~15 s on a busy machine)
def test_concurrent_first_uses_take_turns(tmp_path: Path) -> None:
    """Two processes load one key at once (the compile faked as a 1 s sleep): one compiles, the other waits on the
    lock, then imports the finished build."""
    log = tmp_path / "events"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    procs = [run_python(FAKE_BUILD, env, str(log)) for _ in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
    events = [line.split() for line in log.read_text().splitlines()]
    assert [e[0] for e in events] == ["start", "end", "import"]
    assert float(events[2][1]) >= float(events[1][1])
    (folder,) = (tmp_path / "cache" / "moelane" / "kernels").iterdir()
    assert (folder / "ready").exists()


def test_failed_build_falls_back_and_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(op, "_backend", op._Backend())
    with caplog.at_level(logging.WARNING, logger="moelane.kernels"):
        found = kernels.available()
        pool = random_pool("int4", 2, 5, 48, seed=1)
        x, rows = torch.randn(2, 48), torch.tensor([0, 1, 1])
        y = kernels.gather_linear(x, rows, rows, pool)
        assert kernels.available() == found
    assert found.backend == "fallback" and found.error and "\n" not in found.error
    assert "no-such-compiler not found" in found.error
    assert len([r for r in caplog.records if r.name.startswith("moelane")]) == 1
    want, bound = reference(x, rows, rows, pool)
    assert torch.all((y.double() - want).abs() <= bound)


OUT = {"int8-interleaved": 32}  # output rows of the pools GENERIC computes: 9 (a tail tile), or whole blocks
GENERIC = (
    f"\n    OUT = {OUT!r}"
    + """
    import sys, torch
    from moelane.kernels import build
    from tests.kernels.helpers import random_pool

    module = build.load(sys.argv[2])
    out = {"isa": module.isa()}
    for kind in ("f32", "bf16", "int8", "int4", "int8-interleaved"):
        for n_in in (192, 96, 48, 36, 1056):
            pool = random_pool(kind, 3, OUT.get(kind, 9), n_in, seed=n_in)
            g = torch.Generator().manual_seed(n_in)
            x = torch.randn(6, n_in, generator=g)
            rows, slots = torch.randint(0, 6, (13,), generator=g), torch.randint(0, 3, (13,), generator=g)
            y = module.gather_linear(x, rows, slots, pool.data, pool.scales)
            alone = torch.cat([module.gather_linear(x, rows[p:p + 1], slots[p:p + 1], pool.data, pool.scales)
                               for p in range(13)])
            out[kind, n_in] = (x, rows, slots, y, alone)
    torch.save(out, sys.argv[1])
"""
)


def native_isa() -> str:
    """The ISA of this CPU's own build of the tiles: "avx512", "avx2" or "generic"."""
    return str(build.load().isa())


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "isa"), [("generic", "generic"), ("avx2", "avx2"), ("no-vnni", "avx512")])
def test_portable_tiles(extension: kernels.Availability, tmp_path: Path, variant: str, isa: str) -> None:
    """The tiles for CPUs without AVX-512 (the AVX2 tiles, built here with -mno-avx512f, and the plain C++ ones,
    with -mno-avx2 too), and the AVX-512 tiles without VNNI (int8's integer dot products by pmaddwd; on a CPU with
    AVX-512 only): batch-invariant, within the bound of the float64 reference, and (this CPU having FMA) the same bits
    as the tiles of this CPU."""
    if isa == "avx512" and extension.backend != "avx512":
        pytest.skip("the AVX-512 tiles run on a CPU with AVX-512 only")
    if isa == "avx2" and extension.backend == "generic":
        pytest.skip("the AVX2 tiles run on a CPU with AVX2 only")
    proc = run_python(GENERIC, None, str(tmp_path / "out.pt"), variant)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log
    results = torch.load(tmp_path / "out.pt")
    assert results.pop("isa") == isa
    for (kind, n_in), (x, rows, slots, y, alone) in results.items():
        pool = random_pool(kind, 3, OUT.get(kind, 9), n_in, seed=n_in)
        assert torch.equal(y, alone), (kind, n_in)
        want, bound = reference(x, rows, slots, pool)
        assert torch.all((y.double() - want).abs() <= bound), (kind, n_in)
        assert torch.equal(y, kernels.gather_linear(x, rows, slots, pool)), (kind, n_in)


@pytest.mark.slow
def test_real_concurrent_first_builds(tmp_path: Path) -> None:
    """Two processes building into one empty cache at once both end with the extension; one compiled."""
    code = """
        import logging
        from moelane import kernels
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        print(kernels.ensure_built().backend)
    """
    procs = [run_python(code, {"XDG_CACHE_HOME": str(tmp_path)}) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(out.strip().splitlines()[-1] == native_isa() for out in outs), outs
    assert sum(out.count(build.COMPILE_MESSAGE) for out in outs) == 1
