"""What the commands share: the parser class, the model's flags and its loading, compute threads, output checks."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from moelane.errors import InputError

log = logging.getLogger("moelane")

MAX_THREADS = 256  # (OpenMP crashes on tens of thousands)


class Parser(argparse.ArgumentParser):
    """argparse with its errors in one line, as every other bad input (subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="Hugging Face model folder (default: the shipped model)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (default auto: the checkpoint's own, bfloat16 for one saved in bfloat16 such "
                   "as Qwen3-30B-A3B, float32 otherwise and for the shipped models)")  # fmt: skip
    p.add_argument("--expert-memory", metavar="X", help="budget for resident experts: bytes (512MiB, 2GiB) or a "
                   "share of all expert bytes (25%%); default: all experts resident if they fit in the memory "
                   "free, else paged within it")  # fmt: skip
    p.add_argument("--host-memory", metavar="X", help="budget for host-RAM copies of experts (same units)")
    p.add_argument("--pager-policy", choices=("planner", "lru", "lfu"),
                   help="eviction policy of the expert pool (with --expert-memory; default planner)")  # fmt: skip
    p.add_argument("--default-tier", choices=("native", "int8", "int4"), default="native",
                   help="precision of experts fetched on a miss (native: the checkpoint's own)")  # fmt: skip
    p.add_argument("--threads", type=int, metavar="N", help="compute threads (default: every core for run; every "
                   "core but one for serve, which leaves one to the HTTP server; OMP_NUM_THREADS if set)")  # fmt: skip


def all_resident(args: argparse.Namespace) -> bool:
    """Whether the flags ask for no expert store (one is still used when the experts do not fit in memory)."""
    return not args.expert_memory and not args.host_memory and args.default_tier == "native"


def paged(lm) -> bool:  # type: ignore[no-untyped-def]
    """Whether a loaded model's experts are in an expert store (asked for, or because they did not fit)."""
    from moelane.pager.live.store import ExpertStore

    return isinstance(lm.provider, ExpertStore)


def provider_factory(args: argparse.Namespace) -> Callable[..., object]:
    from moelane.pager.live.build import fitting_factory, store_factory

    policy = args.pager_policy or "planner"
    if all_resident(args):  # all resident if they fit in memory, else paged within what is free
        return fitting_factory(args.host_memory, policy, args.default_tier, progress=True)
    return store_factory(args.expert_memory, args.host_memory, policy, args.default_tier)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else every core)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(args: argparse.Namespace) -> None:
    """torch's compute threads as `--threads` asks (left as they are without it)."""
    import torch

    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise InputError(f"--threads must be at least 1, got {args.threads}")
        if args.threads > MAX_THREADS:
            raise InputError(f"--threads must be at most {MAX_THREADS}, got {args.threads}")
        if args.threads > (cores := usable_cores()):
            log.warning("--threads %d is more than the %d cores this process may use: passes will be slower",
                        args.threads, cores)  # fmt: skip
        torch.set_num_threads(args.threads)


def load_model(args: argparse.Namespace, compile: bool = False):  # type: ignore[no-untyped-def]
    import torch

    import moelane

    set_threads(args)
    from moelane.pager.live.memory import parse_memory

    for flag, value in (("--expert-memory", args.expert_memory), ("--host-memory", args.host_memory)):
        try:
            if value is not None:  # (an empty value was taken as none given)
                parse_memory(value)
        except ValueError as e:
            raise InputError(f"{flag}: {e}") from None
    if args.pager_policy and not args.expert_memory:
        raise InputError("--pager-policy chooses what the expert pool evicts: it needs --expert-memory")
    dtype = {"auto": "auto", "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    factory = provider_factory(args)
    lm = moelane.load(args.model, dtype, provider=factory, compile=compile, progress=True)  # type: ignore[arg-type]
    if paged(lm):  # an expert store: hook its predictors and planner, fit prefill chunks to its pool
        lm.provider.attach(lm)  # type: ignore[attr-defined]
        lm.prefill_chunk = min(lm.prefill_chunk, lm.max_pass_rows() or lm.prefill_chunk)
    return lm


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
