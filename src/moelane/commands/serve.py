"""`moelane serve`: load a model, start the lanes engine on its own thread, serve the OpenAI API with uvicorn.

Binds loopback unless told otherwise. On SIGINT/SIGTERM uvicorn stops accepting connections and waits up to
`--grace` seconds for running requests to finish; whatever still runs then is ended (its engine stream freed, the
client told `server_stopping`: a 503, or a stream's last event), and the engine thread stops. A Ctrl-C while the
model loads exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from moelane.commands.common import add_model_args, load_model, paged
from moelane.model.lm import STEP_POOLS

T = TypeVar("T")

MAX_DEPTH = 64  # most draft rows a stream may hold in a round (each is a row of the pass)
API_KEY_ENV = "MOELANE_API_KEY"
KEY_PARAM = re.compile(r"([?&]key=)[^&\s]*")


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from moelane.lanes.config import DRAFTERS

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                              "/metrics (Prometheus) over the lanes engine.")  # fmt: skip
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address or host name to bind (default 127.0.0.1: this machine)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", metavar="NAME", help="model id clients use (default: the folder's name)")
    p.add_argument("--drafter", choices=("auto", *DRAFTERS), default="auto",
                   help="how the engine drafts tokens to verify (default auto: none with a compiled decode step, "
                   "recall without)")  # fmt: skip
    how = p.add_mutually_exclusive_group()
    how.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                     help="run the streams' generated rows (drafts included) through the compiled decode step, all "
                     "streams in one call (several times faster per stream; prompt rows still share eager passes). "
                     "Compiles once at start-up, 20-120 s, cached for later starts. auto: on when every expert is "
                     "resident (default). The draft model of --drafter model is compiled unless off")  # fmt: skip
    how.add_argument("--eager", dest="compile", action="store_const", const="off",
                     help="never compile (same as --compile off)")  # fmt: skip
    p.add_argument("--guard", choices=("auto", "on", "off"), default="auto",
                   help="shared guard that turns drafting off where it does not pay (auto: engine's)")  # fmt: skip
    p.add_argument("--max-streams", type=int, default=16, help="streams decoded together (default 16; at most 256)")
    p.add_argument("--max-depth", type=int, default=8,
                   help="most draft tokens per stream and round (default 8; at most 64)")  # fmt: skip
    p.add_argument("--prefix-cache", type=int, default=512, metavar="MB",
                   help="MiB of KV cache that finished requests may leave for later requests starting with the same "
                   "tokens (a chat resending its conversation feeds only the new messages; with a compiled decode "
                   "step only a request's prompt is kept, not its reply). Live requests' caches come first. 0: "
                   "off (default 512)")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a stream slot; beyond that: 429 (default 64)")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds a request may wait for its next token, queueing included (default 120)")  # fmt: skip
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds running requests get to finish on shutdown (default 30)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="uvicorn's log level (default info: one line per request)")  # fmt: skip
    p.add_argument("--api-key", metavar="KEY",
                   help=f"a key every endpoint but /health asks for, as 'Authorization: Bearer KEY' (OpenAI clients' "
                   f"api_key); the dashboard takes it once as /dashboard?key=KEY. Default: ${API_KEY_ENV} if set, "
                   "else none (the environment keeps the key out of the process list)")  # fmt: skip
    p.add_argument(
        "--dashboard-show-text",
        action="store_true",
        help="the dashboard's request log shows each prompt's first characters (default: counts only)",
    )
    p.set_defaults(func=cmd_serve)


def build(args: argparse.Namespace) -> Any:
    """The app for these arguments (loads the model, builds the engine; the app's lifespan starts it)."""
    from moelane.lanes.config import EngineConfig
    from moelane.lanes.engine import Engine
    from moelane.server.app import create_app
    from moelane.server.cost import pager_hooks
    from moelane.server.generation import Limits

    # Compute threads: every core, as `run` (no core is left to the HTTP side: measured on 2 cores with
    # bench/serve_bench.py, 2 threads served the inflated model's 1 and 8 clients 1.7-1.9x faster than 1 thread, the
    # shipped model's at the same speed, and GET /v1/models answered in 2-5 ms (p50) under load either way).

    def make() -> tuple[Any, Engine]:
        lm = load_model(args, compile=args.compile == "on")  # (a store's hooks are set up for a compiled step)
        compile = wants_compile(args, paged(lm))
        if compile:
            say("compiling the decode step (20-120 s the first time; later starts use the cache)...")
            if not lm.compile_enabled:
                lm.enable_compile()
            compile = lm.warm_up(1, 1, STEP_POOLS)  # (False: it could not be compiled, and serves eagerly)
        drafter = args.drafter if args.drafter != "auto" else "none" if compile else "recall"
        guard = {"auto": None, "on": True, "off": False}[args.guard]
        config = EngineConfig(drafter=drafter, guard=guard, max_streams=args.max_streams, max_depth=args.max_depth,
                              compile_draft=args.compile != "off", prefix_cache_mb=args.prefix_cache)  # fmt: skip
        if drafter == "model" and config.compile_draft:
            say("compiling the draft model's decode step (10-30 s the first time; later starts: cached)...")
        return lm, Engine(lm, config)  # (which fits its rounds to what an expert store's pool holds)

    # Loading (and the engine's calibration) run parallel torch ops. A thread that has run one keeps an OpenMP team
    # while it lives, and with more teams' threads than cores libgomp barely spins: every parallel op of the engine
    # thread then waits on a futex (measured ~3x slower here). So they run on a thread that ends when they are done.
    lm, engine = off_main_thread(make)
    pager = pager_hooks(lm)
    name = args.served_model_name or Path(lm.folder).name
    limits = Limits(request_s=args.request_timeout, idle_s=args.idle_timeout)
    try:
        fault = (lambda: lm.provider.fault) if hasattr(lm.provider, "fault") else None  # (a distributed run's)
        return create_app(engine, lm, model_name=name, max_queue=args.max_queue, limits=limits, pager=pager,
                          api_key=api_key(args), show_text=args.dashboard_show_text, fault=fault)  # fmt: skip
    except BaseException:  # (a chat template that cannot be compiled): an expert store's threads end first
        lm.close()
        raise


def api_key(args: argparse.Namespace) -> str | None:
    """The key the server asks for: --api-key, else $MOELANE_API_KEY, else none."""
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None


def say(message: str) -> None:
    """A line of serve's own progress on stderr, as `moelane run` says its own (uvicorn logs the requests)."""
    print(message, file=sys.stderr, flush=True)


def wants_compile(args: argparse.Namespace, paged: bool) -> bool:
    """Whether serve compiles the decode step: when asked (`--compile on`), or by default when every expert is
    resident (not `paged`: no `--expert-memory`, and they fit in memory)."""
    return args.compile == "on" or (args.compile == "auto" and not paged)


def check_args(args: argparse.Namespace) -> None:
    """Settings that cannot work, said in one line before the model loads."""
    from moelane.errors import InputError
    from moelane.lanes.config import EngineConfig

    limits = [("--max-streams", args.max_streams, 1, EngineConfig().max_rows),
              ("--max-depth", args.max_depth, 0, MAX_DEPTH)]  # fmt: skip
    for name, value, least, most in limits:
        if not least <= value <= most:
            raise InputError(f"{name} must be in {least}-{most}, got {value}")
    if args.prefix_cache < 0:
        raise InputError(f"--prefix-cache must be at least 0 MiB, got {args.prefix_cache}")
    if args.max_queue < 0:
        raise InputError(f"--max-queue must be at least 0, got {args.max_queue}")
    if not 0 <= args.grace < math.inf:
        raise InputError(f"--grace must be a finite number of seconds >= 0, got {args.grace}")
    for name, value in (("--request-timeout", args.request_timeout), ("--idle-timeout", args.idle_timeout)):
        if not 0 < value < math.inf:
            raise InputError(f"{name} must be a finite number of seconds > 0, got {value}")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in 0-65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key must not be empty")


def bind(host: str, port: int) -> list[socket.socket]:
    """The sockets serve will listen on, bound before the model loads: a port in use is said at once, and the port
    is known (`--port 0`: the one the system chose). One per address the host names: `localhost` is both 127.0.0.1
    and ::1 on many systems, and a client may connect to either (Node's takes the first the system lists, which is
    ::1 on macOS). An address this machine cannot bind (::1 without IPv6) is left out while another one binds."""
    from moelane.errors import InputError

    try:
        addresses = list(dict.fromkeys((info[0], info[4]) for info in
                                       socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))  # fmt: skip
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sockets: list[socket.socket] = []
    try:
        for i, (family, address) in enumerate(addresses):
            if sockets:  # every address on the port the first one got (--port 0: the system chose it)
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
                if family == socket.AF_INET6 and len(addresses) > 1:  # (IPv6 only: the IPv4 address binds its own)
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError as e:
                sock.close()
                if e.errno == errno.EADDRINUSE or (i == len(addresses) - 1 and not sockets):
                    raise
                continue  # an address family or address this machine does not have
            sockets.append(sock)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sockets


def off_main_thread(work: Callable[[], T]) -> T:
    """work() run on a thread of its own, which blocks SIGINT: a Ctrl-C is then delivered to the main thread,
    which waits here, and interrupts the wait at once. (Taken by a thread busy compiling, it was lost: the server
    started a minute later as if no key had been pressed.) The interrupted work cannot be stopped, so the thread
    is a daemon and the caller exits without waiting for it."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # (and so do the threads it starts)
        try:
            done.append(work())
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="moelane-load", daemon=True)
    thread.start()
    while thread.is_alive():  # (in steps: a Ctrl-C that another thread took, tqdm's monitor say, is raised here
        thread.join(0.1)  # only when the wait wakes; a join without a timeout slept on until the load was done)
    if failed:
        raise failed[0]
    return done[0]


class QuietCancels(logging.Filter):
    """uvicorn logs a request that shutdown cancelled (the grace ran out, or a second Ctrl-C) with the whole
    traceback of an application error: here it is one line, and the lifespan task's cancellation none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            record.msg, record.args, record.exc_info, record.exc_text = CUT_OFF, (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        elif isinstance(record.msg, str) and record.msg.startswith("Traceback"):
            return not record.msg.rstrip().endswith("CancelledError")
        return True


class HiddenKey(logging.Filter):
    """uvicorn's access log shows `/dashboard?key=KEY` as `/dashboard?key=...`: a key does not belong in a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str) and "key=" in args[2]:
            record.args = (*args[:2], KEY_PARAM.sub(r"\1...", args[2]), *args[3:])
        return True


CUT_OFF = "a request still running at shutdown was cut off"
ENDING_S = 2.0  # after the grace, how long requests have to send the error that ends them before uvicorn cuts them


def ending_server(config: Any, grace: float, end_requests: Callable[[], None]) -> Any:
    """A uvicorn server that, when `grace` seconds of its shutdown have passed, ends the requests still running
    itself (`end_requests`: the app's `ServerState.shutdown`): a whole reply's request gets a 503 `server_stopping`
    body, a stream that error as its last event before [DONE]. uvicorn alone would cancel them, which cuts a stream
    mid-body and answers the other requests with a bare `Internal Server Error` text; it still does, ENDING_S
    later, for any that has not ended by then."""
    import uvicorn

    class EndingServer(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            timer = asyncio.get_running_loop().call_later(grace, end_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return EndingServer(config)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from moelane.errors import InputError

    check_args(args)
    where = f"[{args.host}]" if ":" in args.host else args.host
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(sock) for sock in bind(args.host, args.port)]
        app = build(args)
        try:
            config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.grace + ENDING_S)
            logging.getLogger("uvicorn.error").addFilter(QuietCancels())  # (after Config, which sets logging up)
            logging.getLogger("uvicorn.access").addFilter(HiddenKey())
            try:  # (connections wait in the backlog until uvicorn's loop takes them)
                for sock in sockets:
                    sock.listen(config.backlog)
            except OSError as e:  # another server (with SO_REUSEADDR) listened on the port while the model loaded
                raise InputError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
            say(f"serving {app.state.moelane.model_name} on http://{where}:{sockets[0].getsockname()[1]}/v1")
            ending_server(config, args.grace, app.state.moelane.shutdown).run(sockets=sockets)
        finally:
            app.state.moelane.lm.close()  # an expert store's threads end before the interpreter does
    return 0
