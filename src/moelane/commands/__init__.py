"""The `moelane` command line: run, serve, bench, trace (`main`; `python -m moelane` runs it too).

This is the one place that configures logging and turns a `MoelaneError` into one line on stderr and exit code 2.
Each command is a module of this package with its own parser (`add_parser(subparsers)`) and handler: `run.py`,
`serve.py`, `trace.py`, `bench.py`; what they share (the model's flags and its loading, threads, output checks) is
in `common.py`. The commands import the library; nothing in the library imports them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

from moelane.commands import bench, run, serve, trace
from moelane.commands.common import Parser, Terminated, distributed_launch
from moelane.errors import MoelaneError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moelane",
        description="Run Mixture-of-Experts language models that do not fit in fast memory, and serve them. "
        "With no --model, commands use the small MoE model shipped inside the package.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"moelane {version()}",
                        help="print moelane's version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in (run, serve, trace, bench):
        module.add_parser(sub)
    for command in leaf_parsers(parser):  # -v after the command too (`moelane run -v hi`)
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log debug messages")  # fmt: skip
    return parser


def leaf_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parsers of the commands that run (`run`, `trace replay`, ...), not of those that only group others."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield parser
    for sub in subs:
        for child in dict.fromkeys(sub.choices.values()):  # (aliases map to the same parser)
            yield from leaf_parsers(child)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("moelane")
    except PackageNotFoundError:  # (run from a source tree that was not installed)
        return "unknown"


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` were parsed for, so that its errors point at its own --help."""
    for name in ("command", "trace_command"):
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, name, None) not in sub.choices:
            break
        parser = sub.choices[getattr(args, name)]
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except MoelaneError as e:  # a value its flag's type refused (`--expert-memory lots`)
        return say_error(str(e))
    if extra:
        words = args.command == "run" and not any(e.startswith("-") for e in extra)
        hint = " (a prompt of several words goes in quotes)" if words else ""
        command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if sys.stdout is None:  # (started with standard output closed: `moelane run hi >&-`)
        return say_error("standard output is closed; redirect it to a file or /dev/null")
    # Denormal floats (tiny attention probabilities, tiny weights) are ~100x slower on x86 and change no token.
    torch.set_flush_denormal(True)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        if distributed_launch():  # (torchrun's environment: one rank of several)
            from moelane.commands.distributed import run_rank

            return run_rank(args)
        return int(args.func(args))
    except MoelaneError as e:
        return say_error(str(e))
    except torch.OutOfMemoryError as e:  # (a device's memory: the host's ends in the OOM killer, not here)
        first = (str(e).strip().splitlines() or ["out of memory"])[0]
        return say_error(f"out of device memory ({first}): give the experts less (--expert-memory), hold them smaller "
                         "(--default-tier int8 or int4, --quantize), or use a device with more memory")  # fmt: skip
    except Terminated:  # (SIGTERM, where the command takes it as Ctrl-C)
        return 143
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except OSError as e:
        if e.filename is not None:  # (a file's error that its command did not say in its own words)
            return say_error(f"{e.filename}: {e.strerror or e}")
        # most likely writing the output failed (`moelane run hi > /dev/full`: the disk is full)
        return say_error(f"cannot write the output: {e.strerror or e}")


def say_error(message: str) -> int:
    """One line on stderr, exit code 2 (stderr itself may be closed or full: the exit code still says it)."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        print(f"moelane: error: {message}", file=sys.stderr, flush=True)
    return 2
