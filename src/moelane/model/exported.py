"""The resident decode step compiled ahead of time: `LM._decode_step` exported once per pool count (`torch.export`,
non-strict) and compiled by AOTInductor into a shared library that Python calls with a flat list of tensors.

Why: through `torch.compile`, each step pays Dynamo's entry (guards, frame) and Inductor's Python wrapper, ~0.4 ms
of a ~1.7 ms step on the 115M model; the exported step is one C++ call (docs/kernels.md "Against llama.cpp").

- The graph is the compiled step's: the same kernels and reductions, with the row count, the reach and each pool's
  slots and capacity as symbols, so a row's bits do not depend on what shares the call (docs/batch-invariance.md).
- The library holds no weights (`package_constants_in_so=False`). The LM's own tensors are handed to it at load,
  user-managed: nothing is copied. For that every tensor the step reads is a buffer of the exported module, with
  a name the library keeps: tensors held outside modules' parameters (kernel pools, the expert provider's pools)
  are registered as buffers, and during the trace the objects that hold them are rebuilt around the buffers.
- The library is cached under `~/.cache/moelane/steps/`, keyed by the exported graph, the buffers' shapes and
  dtypes, torch's version, the CPU's vector ISA and the thread count: a second load of the same model skips the
  ~15 s compile. It keeps the KEEP_STEPS most recently used libraries and any used within STEP_MAX_AGE_S
  (`prune`).
- Anything that fails (export, compile, a weight the library asks for and the LM does not hold) raises; `LM` then
  uses `torch.compile`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moelane.kernels.build import user_cache

log = logging.getLogger(__name__)
KEEP_STEPS = 32  # compiled libraries the step cache keeps whatever their age (`prune`)
STEP_MAX_AGE_S = 7 * 24 * 3600  # ... and beyond those, any used within this long

# Module attributes that are nn.Module's own bookkeeping, not what a forward reads.
_MODULE_STATE = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _tensors(x: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors inside `x`: through tuples, lists, dicts and dataclasses (what holds weights here), no further."""
    if isinstance(x, torch.Tensor):
        yield x
    elif depth > 6 or isinstance(x, str | bytes | int | float | bool | type(None) | nn.Module):
        return
    elif isinstance(x, tuple | list):
        for v in x:
            yield from _tensors(v, depth + 1)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v, depth + 1)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name), depth + 1)


def _rebuilt(x: Any, alias: dict[int, torch.Tensor], depth: int = 0) -> Any:
    """`x` with each tensor whose id is in `alias` replaced, its containers copied (the originals are untouched)."""
    if isinstance(x, torch.Tensor):
        return alias.get(id(x), x)
    if depth > 6 or isinstance(x, str | bytes | int | float | bool | type(None) | nn.Module):
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)._make(_rebuilt(v, alias, depth + 1) for v in x)  # type: ignore[attr-defined]
    if isinstance(x, tuple | list):
        return type(x)(_rebuilt(v, alias, depth + 1) for v in x)
    if isinstance(x, dict):
        return {k: _rebuilt(v, alias, depth + 1) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        y = copy.copy(x)
        for f in dataclasses.fields(x):
            object.__setattr__(y, f.name, _rebuilt(getattr(x, f.name), alias, depth + 1))
        return y
    return x


def _attributes(obj: Any) -> dict[str, Any]:
    """What an object (a module, the provider) holds that a forward may read."""
    return {k: v for k, v in vars(obj).items() if k not in _MODULE_STATE}


def held_tensors(model: nn.Module, provider: Any) -> dict[str, torch.Tensor]:
    """Every tensor a step may read that is not a parameter or buffer of `model`: those in its modules' attributes
    (kernel pools, rotary tables) and in the provider's, named in a fixed order (modules', then the provider's)."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    seen: set[int] = set()
    held: dict[str, torch.Tensor] = {}
    for holder in [m for _, m in model.named_modules()] + [provider]:
        for value in _attributes(holder).values():
            for t in _tensors(value):
                if id(t) not in own and id(t) not in seen:
                    seen.add(id(t))
                    held[f"held_{len(held)}"] = t
    return held


@contextmanager
def _aliased(model: nn.Module, provider: Any, alias: dict[int, torch.Tensor]) -> Iterator[Any]:
    """Within: `model`'s modules hold `alias`'s tensors in place of the ones they stand for, and the provider
    yielded is a copy holding them too. Every module's attributes are put back after (a trace must leave no fake
    tensor behind)."""
    kept = [(m, dict(vars(m))) for m in model.modules()]
    try:
        for m in model.modules():
            for k, v in _attributes(m).items():
                if any(id(t) in alias for t in _tensors(v)):
                    m.__dict__[k] = _rebuilt(v, alias)
        stand_in = copy.copy(provider)
        for k, v in _attributes(provider).items():
            stand_in.__dict__[k] = _rebuilt(v, alias)
        yield stand_in
    finally:
        for m, attributes in kept:
            m.__dict__.clear()
            m.__dict__.update(attributes)


def touch(path: Path) -> None:
    """Mark a cached library as just used (its mtime: `prune` keeps the most recently used)."""
    with contextlib.suppress(OSError):  # (a read-only cache still serves)
        os.utime(path)


def prune(folder: Path, keep: int, max_age_s: float) -> None:
    """Delete the libraries in `folder` that are neither among the `keep` most recently used (mtime) nor used within
    `max_age_s`. Keys change with the model, torch, the CPU's ISA and the thread count, so without this the cache only
    grows (~2-3 MB a library); the age spares a run that compiles many at once (a test suite) its own. A library
    deleted under another process that was about to load it fails that load, which then compiles the step with
    `torch.compile` (see the module docstring)."""
    oldest = time.time_ns() - int(max_age_s * 1e9)
    try:
        found = [(p.stat().st_mtime_ns, p) for p in folder.glob("*.pt2")]
    except OSError:
        return
    for mtime, p in sorted(found, reverse=True)[keep:]:
        if mtime >= oldest:
            continue
        try:
            p.unlink(missing_ok=True)
        except OSError:  # (another user's cache, read-only: leave it)
            return
        log.debug("dropped the cached decode step %s (least recently used of %d)", p.name, len(found))


def compile_to(program: torch.export.ExportedProgram, path: Path) -> None:
    """AOTInductor's library of `program`, without its weights, written to `path` whole or not at all (a reader never
    sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder, warnings.catch_warnings():
        # (torch's own pytree code warns of its deprecated LeafSpec while packaging: nothing a user can act on)
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        made = torch._inductor.aoti_compile_and_package(
            program, package_path=f"{folder}/step.pt2", inductor_configs={"aot_inductor.package_constants_in_so": False}
        )
        os.replace(made, path)


class _KV:
    """A pool's per-layer K and V as the step reads them (`pool.k[layer]`, `pool.v[layer]`), from inputs."""

    def __init__(self, k: dict[int, torch.Tensor], v: dict[int, torch.Tensor]) -> None:
        self.k, self.v = k, v


class _Step(nn.Module):
    """The step over `n_pools` pools, with every input a tensor: per pool its rows [n, 3] and keys [reach], then
    each pool's K tensors (attention layers in order), then its V tensors."""

    def __init__(self, step: Callable[..., torch.Tensor], model: nn.Module, provider: Any, layers: list[int],
                 held: dict[str, torch.Tensor]) -> None:  # fmt: skip
        super().__init__()
        self.step, self.decoder, self.provider, self.layers = step, model, provider, layers
        self.ids = {name: id(t) for name, t in held.items()}
        for name, t in held.items():
            self.register_buffer(name, t)

    def forward(self, rows: list[torch.Tensor], keys: list[torch.Tensor], ks: list[torch.Tensor],
                vs: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        alias = {i: getattr(self, name) for name, i in self.ids.items()}
        n = len(self.layers)
        pools = [_KV(dict(zip(self.layers, ks[p * n : (p + 1) * n], strict=True)),
                     dict(zip(self.layers, vs[p * n : (p + 1) * n], strict=True)))
                 for p in range(len(rows))]  # fmt: skip
        with _aliased(self.decoder, self.provider, alias) as provider:
            return self.step(self.decoder, provider, list(zip(rows, pools, keys, strict=True)))


class ExportedStep:
    """Callable as the compiled step is (`parts`: per pool, its rows, the pool and its keys) -> logits [N, vocab];
    one library per pool count, made (or read from the cache) at the first call with that many pools."""

    def __init__(self, step: Callable[..., torch.Tensor], model: nn.Module, provider: Any,
                 shapes: dict[int, tuple[int, int, int]], dtype: torch.dtype, device: torch.device,
                 max_rows: int, max_context: int) -> None:  # fmt: skip
        self.step, self.model, self.provider = step, model, provider
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.layers = sorted(shapes)
        self.max_rows, self.max_context = max_rows, max_context
        self.held: dict[str, torch.Tensor] = {}
        self._runners: dict[tuple[int, int], Any] = {}  # by pool count and thread count

    def __call__(self, parts: list[tuple[torch.Tensor, Any, torch.Tensor]]) -> torch.Tensor:
        # (Inductor writes the thread count into its kernels: a library per count the step is called at)
        runner = self._runners.get((len(parts), torch.get_num_threads())) or self.build(len(parts))
        flat = [r for r, _, _ in parts] + [keys for _, _, keys in parts]
        flat += [pool.k[layer] for _, pool, _ in parts for layer in self.layers]
        flat += [pool.v[layer] for _, pool, _ in parts for layer in self.layers]
        out: torch.Tensor = runner.boxed_run(flat)[0]
        return out

    def build(self, n_pools: int) -> Any:
        """The library for `n_pools` pools, loaded with the LM's weights (exported and compiled, or cached)."""
        started = time.perf_counter()
        self.held = held_tensors(self.model, self.provider)  # (as the model holds them now: weights are prepared)
        program = self._export(n_pools)
        path = user_cache("steps") / f"{self._key(program)}.pt2"
        if path.exists():
            touch(path)
        else:
            log.info("compiling the decode step for %d pool(s) ahead of time (once per model and torch)", n_pools)
            compile_to(program, path)
            prune(path.parent, KEEP_STEPS, STEP_MAX_AGE_S)
        runner = torch._inductor.aoti_load_package(str(path))
        own = [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers(remove_duplicate=False)]
        weights = {**{f"decoder.{name}": t for name, t in own}, **self.held}
        wanted = runner.get_constant_fqns()
        missing = [name for name in wanted if name not in weights]
        if missing:
            raise RuntimeError(f"the compiled step asks for weights the model does not hold: {missing[:3]}")
        runner.load_constants({name: weights[name].detach() for name in wanted}, check_full_update=True,
                              user_managed=True)  # fmt: skip
        log.debug("decode step for %d pool(s) ready in %.1f s (%s)", n_pools, time.perf_counter() - started, path)
        self._runners[n_pools, torch.get_num_threads()] = runner.loader
        return runner.loader

    def _export(self, n_pools: int) -> torch.export.ExportedProgram:
        """`_Step` over `n_pools` pools exported, every weight a parameter or buffer (else RuntimeError)."""
        from moelane.model.cache import KVPool

        module = _Step(self.step, self.model, self.provider, self.layers, self.held)
        # Example inputs only set the symbols' places: two rows a pool (a size of 1 would be specialised), reaches
        # and capacities within the context that differ between pools and from each other.
        capacities = [self.max_context - 2 * p for p in range(n_pools)]
        pools = [KVPool(self.shapes, c, self.dtype, self.device) for c in capacities]
        rows = [torch.tensor([[0, 0, 0], [0, 1, 1]], device=self.device) for _ in pools]
        keys = [torch.arange(max(2, c // 2 - p), device=self.device) for p, c in enumerate(capacities)]
        ks = [pool.k[layer] for pool in pools for layer in self.layers]
        vs = [pool.v[layer] for pool in pools for layer in self.layers]
        Dim = torch.export.Dim
        row_dims = [{0: Dim(f"rows{p}", min=1, max=self.max_rows)} for p in range(n_pools)]
        key_dims = [{0: Dim(f"reach{p}", min=2, max=self.max_context)} for p in range(n_pools)]
        slot_dims = [Dim(f"slots{p}", min=1, max=1 << 20) for p in range(n_pools)]
        cap_dims = [Dim(f"capacity{p}", min=2, max=self.max_context) for p in range(n_pools)]
        kv_dims = [{0: slot_dims[p], 2: cap_dims[p]} for p in range(n_pools) for _ in self.layers]
        dims = {"rows": row_dims, "keys": key_dims, "ks": kv_dims, "vs": kv_dims}
        # The model's non-persistent buffers (rotary tables) would be exported as constants, whose names the library
        # does not keep: for the export every buffer is persistent.
        transient = [(m, set(m._non_persistent_buffers_set)) for m in self.model.modules()]
        try:
            for m, _ in transient:
                m._non_persistent_buffers_set.clear()
            with torch.no_grad():
                program = torch.export.export(module, (rows, keys, ks, vs), dynamic_shapes=dims, strict=False)
        finally:
            for m, names in transient:
                m._non_persistent_buffers_set.update(names)
        if program.constants:
            raise RuntimeError(f"the step reads {len(program.constants)} tensors it was not given as weights")
        return program

    def _key(self, program: torch.export.ExportedProgram) -> str:
        digest = hashlib.sha256()
        digest.update(program.graph_module.print_readable(print_output=False, include_stride=True).encode())
        digest.update(str(program.graph_signature).encode())
        for name, t in sorted({**program.state_dict}.items()):
            digest.update(f"{name}:{tuple(t.shape)}:{t.stride()}:{t.dtype}".encode())
        capability = torch.backends.cpu.get_cpu_capability()
        digest.update(f"{torch.__version__}:{capability}:{self.device}:{torch.get_num_threads()}".encode())
        return digest.hexdigest()[:32]


class AheadOrCompiled:
    """The exported step, and torch.compile's where it fails: then for every call after, so that a row's bits
    never depend on which of the two computed the call that holds it."""

    def __init__(self, exported: ExportedStep, compiled: Callable[..., torch.Tensor],
                 prepare: Callable[[list[tuple[torch.Tensor, Any, torch.Tensor]]], None]) -> None:  # fmt: skip
        """`prepare(parts)`: what torch.compile's step needs done to its inputs first (`lm.mark_symbolic`)."""
        self.exported: ExportedStep | None = exported
        self.compiled, self.prepare = compiled, prepare

    def __call__(self, parts: list[tuple[torch.Tensor, Any, torch.Tensor]]) -> torch.Tensor:
        if self.exported is not None:
            try:
                return self.exported(parts)
            except Exception as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                log.warning("compiling the decode step ahead of time failed (%s); using torch.compile", reason)
                log.debug("the exported step failed", exc_info=True)
                self.exported = None
        self.prepare(parts)
        return self.compiled(parts)
