"""What the commands share: the parser class, the model's flags and its loading, compute threads, output checks."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

import moelane
from moelane.device import parse as parse_device
from moelane.errors import InputError
from moelane.model.provider import ResidentProvider
from moelane.pager.live.memory import MemorySpec, format_bytes, parse_memory

log = logging.getLogger("moelane")

MAX_THREADS = 256  # (OpenMP crashes on tens of thousands)
SIGNED = re.compile(r"-[\d.]")  # a value such as -5% or -1GiB, which argparse would take for an option
PROGRESS_DELAY_S = 1.0  # a progress bar shows once its work has taken this long (none for quick work)


@dataclass(frozen=True, slots=True)
class MemoryFlag:
    """argparse's `type=` for a flag that takes a memory size (`--expert-memory 25%`): the one place its text is
    parsed. A bad size is an InputError naming the flag, which argparse lets through (it turns only ValueError and
    TypeError into its own message) to `main`, so that it reads as every other bad input does."""

    flag: str

    def __call__(self, text: str) -> MemorySpec:
        try:
            return parse_memory(text)
        except ValueError as e:
            raise InputError(f"{self.flag}: {e}") from None


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other bad input (subcommands' parsers are of this class too).
    A memory flag's value that starts with a minus (`--expert-memory -5%`) is that flag's value, refused by its type
    as `--expert-memory=-5%` is, where argparse alone would take it for an option and say the flag has none."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        args = list(sys.argv[1:] if args is None else args)
        flags = {s for a in self._actions if isinstance(a.type, MemoryFlag) for s in a.option_strings}
        end = args.index("--") if "--" in args else len(args)  # (what follows "--" is positional)
        return super().parse_known_args(joined(args[:end], flags) + args[end:], namespace)


def joined(args: list[str], flags: set[str]) -> list[str]:
    """`args` with each of `flags` that a value starting with a minus follows written as `flag=value`."""
    out: list[str] = []
    for arg in args:
        if out and out[-1] in flags and SIGNED.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="Hugging Face model folder, or GGUF file (a split one by any of "
                   "its parts) (default: the shipped model, a small demo that continues code and plays, not a chat "
                   "model)")  # fmt: skip
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (default auto: the checkpoint's own, bfloat16 for one saved in bfloat16 such "
                   "as Qwen3-30B-A3B, float32 otherwise and for the shipped models)")  # fmt: skip
    p.add_argument("--expert-memory", metavar="X", type=MemoryFlag("--expert-memory"),
                   help="budget for resident experts, each held at its precision tier: bytes (512MiB, 2GiB) or a "
                   "share of all expert bytes in the compute dtype (25%%; at --default-tier int4 that holds ~3.5x the "
                   "experts it holds in bf16); default: all experts resident if they fit in the memory free, else "
                   "paged within it")  # fmt: skip
    p.add_argument("--host-memory", metavar="X", type=MemoryFlag("--host-memory"),
                   help="budget for host-RAM copies of experts (same units)")  # fmt: skip
    p.add_argument("--pager-policy", choices=("planner", "lru", "lfu"),
                   help="eviction policy of the expert pool (with --expert-memory; default planner)")  # fmt: skip
    p.add_argument("--default-tier", choices=("auto", "native", "int8", "int4"), default="auto",
                   help="precision experts are held at in memory (native: the compute dtype; int8 and int4 hold "
                   "more experts in the same memory, at a small cost in quality); all resident at it where they "
                   "fit. Default auto: a GGUF's Q8_0 / Q4_0 experts at int8 / int4 as the file's own codes; its "
                   "K-quant and other block-quantised experts at the nearest tier (Q4_K, Q3_K, ...: int4; Q5_K, Q6_K, "
                   "...: int8; a mix: the tier of most weights), requantised once into a tier file beside the file; "
                   "anything else native. native decodes a GGUF's experts to the compute dtype")  # fmt: skip
    p.add_argument("--quantize", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="hold the dense projections (attention, dense MLPs, shared experts, the LM head) quantised, "
                   "as a llama.cpp Q8_0 / Q4_0 file does (int4 holds the LM head at int8, as Q4_0 files hold it "
                   "at Q6_K or Q8_0); with --default-tier of the same precision the whole model is. Default auto: "
                   "a GGUF's Q8_0 / Q4_0 projections at int8 / int4 as the file's own codes, its K-quant and other "
                   "block-quantised ones at the nearest of the two, anything else as stored (none)")  # fmt: skip
    p.add_argument("--device", default="cpu", metavar="D",
                   help="where the model computes: cpu, cuda or cuda:N. On a GPU the dense weights, KV caches and "
                   "expert pool live in its memory: --expert-memory is then the GPU's expert pool and --host-memory "
                   "pinned host RAM behind it (default cpu; docs/accelerator.md)")  # fmt: skip
    p.add_argument("--threads", type=int, metavar="N",
                   help="compute threads (default: every core; OMP_NUM_THREADS if set)")  # fmt: skip
    p.add_argument("--dist-timeout", type=float, default=30.0, metavar="S",
                   help="launched by torchrun (experts spread over its ranks: docs/distributed.md): how long rank 0 "
                   "waits for another rank's experts before it fails the requests in flight and reports itself "
                   "degraded (default 30 s)")  # fmt: skip
    p.add_argument("--placement", choices=("contiguous", "balanced"), default="contiguous",
                   help="launched by torchrun: which rank holds which experts. contiguous: rank r of W holds expert "
                   "ids [r*E/W, (r+1)*E/W) of every MoE layer; balanced: as many per rank, chosen so that the ranks "
                   "carry equal shares of the routing counted in --placement-trace (rank 0 chooses for every rank) "
                   "(default contiguous)")  # fmt: skip
    p.add_argument("--placement-trace", metavar="FILE",
                   help="with --placement balanced: a `moelane trace record` file of this model, whose routing "
                   "counts balance the ranks")  # fmt: skip


def placement_trace(args: argparse.Namespace, distributed: bool) -> str | None:
    """The trace `--placement balanced` balances by (None: contiguous); InputError for flags that do not go together.
    `distributed`: whether this process is one rank of a torchrun launch."""
    balanced, trace = getattr(args, "placement", "contiguous") == "balanced", getattr(args, "placement_trace", None)
    if balanced and not distributed:
        raise InputError("--placement balanced spreads experts over the ranks of a torchrun launch; this process runs "
                         "alone (docs/distributed.md)")  # fmt: skip
    if balanced and trace is None:
        raise InputError("--placement balanced needs --placement-trace FILE (a `moelane trace record` file of this "
                         "model)")  # fmt: skip
    if trace is not None and not balanced:
        raise InputError("--placement-trace is read with --placement balanced only")
    return trace


def paged(lm: Any) -> bool:
    """Whether a loaded model's experts are not all resident in this process (in an expert store, asked for or
    because they did not fit, or spread over the ranks of a distributed run): its decode step is then not compiled
    unless asked."""
    return not isinstance(lm.provider, ResidentProvider)


def distributed_launch() -> bool:
    """Whether torchrun started this process as one rank of several (its RANK and WORLD_SIZE in the environment)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1") or "1") > 1


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(args: argparse.Namespace) -> None:
    """torch's compute threads as `--threads` asks (left as they are without it)."""
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise InputError(f"--threads must be at least 1, got {args.threads}")
        if args.threads > MAX_THREADS:
            raise InputError(f"--threads must be at most {MAX_THREADS}, got {args.threads}")
        if args.threads > (cores := usable_cores()):
            log.warning("--threads %d is more than the %d cores this process may use: passes will be slower",
                        args.threads, cores)  # fmt: skip
        torch.set_num_threads(args.threads)


def load_model(args: argparse.Namespace, compile: bool = False) -> Any:
    """The model the flags ask for, its experts in a store attached to it where they are paged (`moelane.load`)."""
    set_threads(args)
    device = parse_device(args.device)
    if args.pager_policy and args.expert_memory is None:
        raise InputError("--pager-policy chooses what the expert pool evicts: it needs --expert-memory")
    ranks = getattr(args, "ranks", None)
    trace = placement_trace(args, ranks is not None)
    if ranks is not None:  # (rank 0 of a distributed run: `moelane.commands.distributed`)
        from moelane import dist

        if device.type != "cpu":
            raise InputError(f"--device {args.device}: a distributed run computes on its ranks' CPUs")
        if compile:
            raise InputError("--compile on: a distributed run computes eagerly (its experts' outputs are exchanged "
                             "between ranks in every MoE layer)")  # fmt: skip
        lm = dist.load(ranks, args.model, DTYPES[args.dtype], expert_memory=args.expert_memory,
                       host_memory=args.host_memory, policy=args.pager_policy or "planner",
                       default_tier=args.default_tier, progress=True, quantize=args.quantize,
                       placement_trace=trace)  # fmt: skip
    else:
        lm = moelane.load(args.model, DTYPES[args.dtype], expert_memory=args.expert_memory,
                          host_memory=args.host_memory, policy=args.pager_policy or "planner",
                          default_tier=args.default_tier, compile=compile, progress=True,
                          quantize=args.quantize, device=device)  # fmt: skip
    try:
        check_pool(lm, args.expert_memory)
    except InputError:
        lm.close()
        raise
    return lm


def check_pool(lm: Any, expert_memory: MemorySpec | None) -> None:
    """InputError if the expert pool cannot hold the experts one token routes to in one MoE layer, so that no pass
    could run: said in one line before anything runs (the engine would first warn of the rows a pass may hold). A
    distributed run's provider has no pool of its own: each rank checks its share as it builds it (`dist.launch`)."""
    if not paged(lm) or not hasattr(lm.provider, "n_slots"):
        return
    if (n_slots := lm.provider.n_slots) >= (top_k := lm.args.num_experts_per_tok):
        return
    need = top_k * lm.provider.slot_bytes
    share = math.ceil(need / lm.provider.total_bytes * 1000) / 10  # (rounded up: a budget of it holds them)
    given = "the free memory" if expert_memory is None else f"--expert-memory {expert_memory}"
    raise InputError(f"{given} holds {n_slots} expert{'s' * (n_slots != 1)}, but a token routes to {top_k} at once "
                     f"in each MoE layer: give at least {format_bytes(need)} ({share:g}%)")  # fmt: skip


DTYPES: dict[str, torch.dtype | str] = {"auto": "auto", "bfloat16": torch.bfloat16, "float32": torch.float32}


@contextlib.contextmanager
def in_flags(names: frozenset[str]) -> Iterator[None]:
    """Errors in a setting's own words (`top_p must be ...`, as the API and the server say them) name the flag the
    user typed instead (`--top-p must be ...`), for the settings in `names`."""
    try:
        yield
    except (InputError, ValueError) as e:
        name, _, rest = str(e).partition(" ")
        raise InputError(f"--{name.replace('_', '-')} {rest}" if name in names else str(e)) from None


def check_output(path: str, flag: str) -> None:
    """InputError, before any work is done, if `path` cannot become a file: it is a folder, or its folder is
    missing or not writable."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file name")
    if not folder.is_dir():
        raise InputError(f"{flag} {path}: no such folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot write in {folder} (permission denied)")


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is (`terminated_as_interrupt`): the command stops the same way and says the same;
    `main` exits 143 for it (128 + SIGTERM), 130 for Ctrl-C."""


@contextlib.contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM raises `Terminated` in the main thread, as Ctrl-C raises KeyboardInterrupt, so a
    command that writes a file as it goes ends it the same way (what was written stays, and it says so); the previous
    handler is put back after. Elsewhere than in the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that come while the block runs are taken once it is done (a file's record and its count
    stay together). Their handlers are swapped for the block's time: a thread mask would not do, since the kernel
    hands a signal to any thread that does not block it (tqdm's monitor, say) and Python then runs the handler in
    the main thread all the same. Elsewhere than in the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if came:
            signal.raise_signal(came[0])  # (to the handler it would have reached)


def progress(total: int, what: str, unit: str) -> Any:
    """A progress bar on stderr (`what: done/total [elapsed<left, rate unit/s]`) moved by `.update(n)`; shown once
    the work has taken `PROGRESS_DELAY_S` and cleared when it ends, so that the line after it is the last one."""
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit=unit, delay=PROGRESS_DELAY_S, leave=False, file=sys.stderr)


def say_written(path: str, requests: int, segments: int, tokens: int) -> None:
    """The one line a command that wrote a trace ends with: the file, what it holds, its size."""
    size = format_bytes(Path(path).stat().st_size)
    print(f"wrote {path}: {requests} requests, {segments} segments, {tokens} tokens, {size}", file=sys.stderr,
          flush=True)  # fmt: skip
