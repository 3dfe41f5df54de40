"""The custom op `moelane::gather_linear`, its two implementations, and the functions callers use.

    torch.ops.moelane.gather_linear(x, rows?, slots?, data, scales?) -> y     (the schema; registered at import)
        CPU: the C++ extension (build.py; its kernels registered from C++, so the dispatcher calls them without
             Python), or where it cannot be built, fallback.py (by this module's Python kernel)
        CUDA: a Triton kernel (cuda.py), imported at the first product on a CUDA tensor
        fake: y's shape [P, Out], so torch.compile(fullgraph=True) traces through it without a graph break

Every call, eager or traced, goes through the op: once the extension serves, the dispatcher calls its C++ kernel
directly. The extension is built on first use (the Python kernel's first call at the latest), not at import. Which
implementation runs is decided once per process (the first call, `available()` or `ensure_built()`); a build failure
is logged once as a WARNING and the fallback serves from then on. Tests may force the fallback with
`use_fallback(True)`; nothing else chooses (no environment variable).

Shape alphabet: R activation rows, In input columns, P pairs, Out output rows, S pool slots.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from moelane.kernels import build, fallback
from moelane.kernels.pool import BLOCK_ROWS, Pool

log = logging.getLogger(__name__)

torch.library.define(
    "moelane::gather_linear", "(Tensor x, Tensor? rows, Tensor? slots, Tensor data, Tensor? scales) -> Tensor"
)
torch.library.define(
    "moelane::attend_cache",
    "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor mask, Tensor? sinks, float scale) -> Tensor",
)


@dataclass(frozen=True, slots=True)
class Availability:
    """Which implementation serves `gather_linear`: "avx512", "avx2" or "generic" (the extension's tiles) or "fallback";
    `error` is the build failure in one line when the extension could not be used."""

    backend: str
    error: str | None = None


class _Backend:
    """The process's choice of implementation: the extension, loaded once, unless the fallback is forced."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: ModuleType | None = None
        self.error: str | None = None
        self.tried = False
        self.forced = False

    def extension(self, on_compile: Callable[[str], None] | None = None) -> ModuleType | None:
        if not self.tried:
            with self.lock:
                if not self.tried:
                    try:
                        self.module = build.load(on_compile=on_compile)
                    except build.BuildError as e:
                        self.error = str(e)
                        log.warning("moelane's CPU kernels are unavailable, using the slow fallback: %s", e)
                    self.sync()
                    self.tried = True
        return None if self.forced else self.module

    def sync(self) -> None:
        """The dispatcher's CPU kernels: the extension's own C++ kernels while it serves (compiled code's op calls
        then never enter Python), else this module's Python ones, which call the fallback."""
        if self.module is not None:
            self.module.register_cpu(not self.forced)


_backend = _Backend()


def use_fallback(on: bool) -> None:
    """Force (or stop forcing) the pure-PyTorch implementation. For tests."""
    with _backend.lock:
        _backend.forced = on
        _backend.sync()


def ensure_built(on_compile: Callable[[str], None] | None = None) -> Availability:
    """Build or load the extension now rather than at the first product; `on_compile(message)` is called before a
    compile starts (the CLI prints it to stderr). -> which implementation serves."""
    module = _backend.extension(on_compile)
    if module is None:
        return Availability("fallback", _backend.error)
    return Availability(str(module.isa()))


def available() -> Availability:
    return ensure_built()


def _gather_linear_cpu(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    slots: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    module = _backend.extension()
    if module is None:
        return fallback.gather_linear(x, rows, slots, data, scales)
    y = module.gather_linear.default(x, rows, slots, data, scales)
    assert isinstance(y, torch.Tensor)
    return y


# (registered by a call, not as a decorator, which would leave the name None. The first call comes here; while the
# extension serves, its C++ kernels stand in front of this one in the dispatcher: `_Backend.sync`.)
torch.library.impl("moelane::gather_linear", "cpu")(_gather_linear_cpu)


@torch.library.impl("moelane::gather_linear", "cuda")
def _gather_linear_cuda(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    slots: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    from moelane.kernels import cuda  # (Triton: imported by a CUDA run only)

    return cuda.gather_linear(x, rows, slots, data, scales)


def serves(device: torch.device) -> bool:
    """Whether `gather_linear` computes on `device` at its own speed: the CPU extension built (else the slow
    fallback), or Triton importable for a CUDA device; on the meta device (shapes only, as the tests run a model
    there) the op's fake answers. Where it does not, callers keep weights as tensors."""
    if device.type == "cpu":
        return _backend.extension() is not None
    if device.type == "meta":
        return True
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.register_fake("moelane::gather_linear")  # type: ignore[untyped-decorator]
def _gather_linear_fake(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    slots: torch.Tensor | None,
    data: torch.Tensor,
    scales: torch.Tensor | None,
) -> torch.Tensor:
    n_pairs = x.shape[0] if rows is None else rows.shape[0]
    n_out = data.shape[1] * (BLOCK_ROWS if data.dim() == 4 else 1)  # (4-D: interleaved int8, pool.py)
    return x.new_empty((n_pairs, n_out))


def _attend_cache_cpu(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    module = _backend.extension()
    if module is None:
        return fallback.attend_cache(q, k_pool, v_pool, slots, mask, sinks, scale)
    y = module.attend_cache.default(q, k_pool, v_pool, slots, mask, sinks, scale)
    assert isinstance(y, torch.Tensor)
    return y


torch.library.impl("moelane::attend_cache", "cpu")(_attend_cache_cpu)


@torch.library.register_fake("moelane::attend_cache")  # type: ignore[untyped-decorator]
def _attend_cache_fake(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], v_pool.shape[3]), dtype=v_pool.dtype)


def attends_in_place(device: torch.device) -> bool:
    """Whether `attend_cache` computes on `device` at its own speed: the CPU extension built (else callers keep
    their own attention), or the meta device (shapes only). Traceable: compiled code asks it too."""
    return device.type in ("cpu", "meta") and serves(device)


def attend_cache(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of N query rows over their slots' caches, read in place (csrc/attention.cpp):
    q [N, Hq, D], k_pool [S, Hkv, C, D], v_pool [S, Hkv, C, Dv], slots [N], mask [N, L] (the keys l < L each row
    sees), sinks [Hq] logits or None -> [N, Hq, Dv] in the pools' dtype, computed in fp32.

    Each row's result is the same bits whatever N, the other rows, L past its last visible key and the thread count.
    CPU only (`serves`)."""
    out: torch.Tensor = torch.ops.moelane.attend_cache.default(q, k_pool, v_pool, slots, mask, sinks, scale)
    return out


def gather_linear(x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, pool: Pool) -> torch.Tensor:
    """y[p] = x[rows[p]] @ W[slots[p]].T: x [R, In] float32, rows / slots [P] int64 -> y [P, Out] float32.

    Each y[p] is the same bits whatever P, the other pairs and the thread count (see moelane.kernels)."""
    _check_x(x, pool, 2)
    return _call(x, rows, slots, pool)


def linear(x: torch.Tensor, pool: Pool) -> torch.Tensor:
    """A dense layer: x [..., In] float32 @ W.T for a pool of one slot -> [..., Out] (no index tensors built)."""
    if pool.n_slots != 1:
        raise ValueError(f"linear takes a pool of one matrix, got {pool.n_slots}")
    _check_x(x, pool, None)
    if x.dim() == 2:
        return _call(x, None, None, pool)
    return _call(x.reshape(-1, x.shape[-1]), None, None, pool).view(*x.shape[:-1], pool.out_features)


def _call(x: torch.Tensor, rows: torch.Tensor | None, slots: torch.Tensor | None, pool: Pool) -> torch.Tensor:
    """The op, eager or traced: on the CPU the extension's C++ kernel once it serves (`_Backend.sync`), else the
    Python kernel above, whose first call loads the extension (~3.4 us a call from Python either way, for a [4, 64]
    product: docs/kernels.md "Building")."""
    y: torch.Tensor = torch.ops.moelane.gather_linear.default(x, rows, slots, pool.data, pool.scales)
    return y


def _check_x(x: torch.Tensor, pool: Pool, dims: int | None) -> None:
    if x.dtype != torch.float32 or (dims is not None and x.dim() != dims) or x.shape[-1] != pool.in_features:
        raise ValueError(
            f"x must be float32 [{'R, ' if dims else '..., '}{pool.in_features}], got {x.dtype} {tuple(x.shape)}"
        )
