"""What the commands share: the parser class, the model's flags and its loading, compute threads, output checks."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

import moelane
from moelane.errors import InputError
from moelane.model.provider import ResidentProvider
from moelane.pager.live.memory import MemorySpec, parse_memory

log = logging.getLogger("moelane")

MAX_THREADS = 256  # (OpenMP crashes on tens of thousands)
SIGNED = re.compile(r"-[\d.]")  # a value such as -5% or -1GiB, which argparse would take for an option


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
                   "its parts) (default: the shipped model)")  # fmt: skip
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
    p.add_argument("--default-tier", choices=("native", "int8", "int4"), default="native",
                   help="precision experts are held at in memory (native: the compute dtype; int8 and int4 hold "
                   "more experts in the same memory, at a small cost in quality); all resident at it where they "
                   "fit")  # fmt: skip
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none",
                   help="hold the dense projections (attention, dense MLPs, shared experts, the LM head) quantised, "
                   "as a llama.cpp Q8_0 / Q4_0 file does; with --default-tier of the same precision the whole model "
                   "is (default none: as stored)")  # fmt: skip
    p.add_argument("--threads", type=int, metavar="N", help="compute threads (default: every core for run; every "
                   "core but one for serve, which leaves one to the HTTP server; OMP_NUM_THREADS if set)")  # fmt: skip
    p.add_argument("--dist-timeout", type=float, default=30.0, metavar="S",
                   help="launched by torchrun (experts spread over its ranks: docs/distributed.md): how long rank 0 "
                   "waits for another rank's experts before it fails the requests in flight and reports itself "
                   "degraded (default 30 s)")  # fmt: skip


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
    if args.pager_policy and args.expert_memory is None:
        raise InputError("--pager-policy chooses what the expert pool evicts: it needs --expert-memory")
    ranks = getattr(args, "ranks", None)
    if ranks is not None:  # (rank 0 of a distributed run: `moelane.commands.distributed`)
        from moelane import dist

        if compile:
            raise InputError("--compile on: a distributed run computes eagerly (its experts' outputs are exchanged "
                             "between ranks in every MoE layer)")  # fmt: skip
        return dist.load(ranks, args.model, DTYPES[args.dtype], expert_memory=args.expert_memory,
                         host_memory=args.host_memory, policy=args.pager_policy or "planner",
                         default_tier=args.default_tier, progress=True, quantize=args.quantize)  # fmt: skip
    return moelane.load(args.model, DTYPES[args.dtype], expert_memory=args.expert_memory, host_memory=args.host_memory,
                        policy=args.pager_policy or "planner", default_tier=args.default_tier, compile=compile,
                        progress=True, quantize=args.quantize)  # fmt: skip


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
