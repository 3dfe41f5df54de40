"""`moelane serve`'s flags (when the decode step is compiled), Ctrl-C while it loads, its shutdown log, and the
requests its shutdown ends."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import uvicorn

from moelane.commands import build_parser, main
from moelane.commands.serve import (
    CUT_OFF,
    ENDING_S,
    QuietCancels,
    bind,
    ending_server,
    off_main_thread,
    wants_compile,
)
from moelane.errors import InputError
from moelane.server.app import create_app
from tests.server.conftest import MODEL, make_engine, wait_until


def serve_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "paged", "compiled"),
    [
        ((), False, True),  # all experts resident: compiled, whatever the drafter
        (("--drafter", "none"), False, True),
        (("--drafter", "recall"), False, True),
        ((), True, False),  # experts that did not fit in memory: a store, eager
        (("--expert-memory", "50%"), True, False),  # a store: eager
        (("--eager",), False, False),
        (("--compile", "on", "--expert-memory", "50%"), True, True),
    ],
)
def test_serve_compiles_where_it_can(argv: tuple[str, ...], paged: bool, compiled: bool) -> None:
    assert wants_compile(serve_args(*argv), paged) is compiled


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--max-streams", "0"), "--max-streams must be in 1-256"),
        (("--max-streams", "99999"), "--max-streams must be in 1-256"),
        (("--max-depth", "-1"), "--max-depth must be in 0-64"),
        (("--max-depth", "9999"), "--max-depth must be in 0-64"),
        (("--max-queue", "-1"), "--max-queue must be at least 0"),
        (("--prefix-cache", "-1"), "--prefix-cache must be at least 0 MiB"),
        (("--grace", "-1"), "--grace must be a finite number of seconds >= 0"),
        (("--grace", "nan"), "--grace must be a finite number of seconds >= 0"),
        (("--grace", "inf"), "--grace must be a finite number of seconds >= 0"),
        (("--request-timeout", "-1"), "--request-timeout must be a finite number of seconds > 0"),
        (("--idle-timeout", "0"), "--idle-timeout must be a finite number of seconds > 0"),
        (("--idle-timeout", "inf"), "--idle-timeout must be a finite number of seconds > 0"),
        (("--port", "99999"), "--port must be in 0-65535"),
        (("--port", "{busy}"), "Address already in use"),
    ],
)
def test_bad_serve_settings_are_one_line_errors_before_loading(
    argv: tuple[str, ...], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Said in one line with exit 2, before the model loads (`--model` names no folder: loading would fail)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = [a.replace("{busy}", port) for a in argv]
        assert main(["serve", "--model", "/nonexistent", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moelane: error:") and needle in err[0], err


def names(*addresses: str):  # type: ignore[no-untyped-def]
    """A getaddrinfo that gives `addresses`, in order, for any host (as a system whose localhost is two)."""

    def getaddrinfo(host: str, port: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in addresses]  # fmt: skip

    return getaddrinfo


def ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def answers(address: str, port: int) -> bool:
    with socket.create_connection((address, port), timeout=5):
        return True


@pytest.mark.skipif(not ipv6(), reason="this machine cannot bind ::1")
@pytest.mark.parametrize("first", ["127.0.0.1", "::1"])
def test_a_host_of_two_addresses_is_served_on_both(monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """`--host localhost` where localhost is 127.0.0.1 and ::1: a client may connect to either (only the first
    was bound)."""
    other = "::1" if first == "127.0.0.1" else "127.0.0.1"
    monkeypatch.setattr(socket, "getaddrinfo", names(first, other))
    sockets = bind("localhost", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == [first, other]
        port = sockets[0].getsockname()[1]
        assert {s.getsockname()[1] for s in sockets} == {port}  # (--port 0: the port the system chose, on both)
        for s in sockets:
            s.listen()
        assert answers("127.0.0.1", port) and answers("::1", port)
    finally:
        for s in sockets:
            s.close()


def test_an_address_the_machine_lacks_is_left_out_unless_it_is_all(monkeypatch: pytest.MonkeyPatch) -> None:
    lacking = "192.0.2.1"  # (TEST-NET-1: no machine's address)
    monkeypatch.setattr(socket, "getaddrinfo", names(lacking, "127.0.0.1"))
    sockets = bind("localhost", 0)
    assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
    sockets[0].close()
    monkeypatch.setattr(socket, "getaddrinfo", names(lacking))
    with pytest.raises(InputError, match="cannot listen on localhost:0"):
        bind("localhost", 0)


@pytest.mark.skipif(not ipv6(), reason="this machine cannot bind ::1")
def test_a_port_in_use_on_any_address_of_the_host_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET6) as busy:
        busy.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        busy.bind(("::1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(socket, "getaddrinfo", names("127.0.0.1", "::1"))
        with pytest.raises(InputError, match="Address already in use"):
            bind("localhost", port)


def test_loading_off_the_main_thread_returns_or_raises_what_the_work_did() -> None:
    assert off_main_thread(lambda: threading.current_thread().name) == "moelane-load"
    with pytest.raises(ZeroDivisionError):
        off_main_thread(lambda: 1 / 0)


# Run in a process of their own, as a terminal starts it: SIGINT handled, as Python sets it up unless the process
# started with SIGINT ignored, as a shell's background job does (these tests failed in CI runs started with `&`).
PRESS_CTRL_C = """
import os, signal, sys, threading, time
from moelane.commands.serve import off_main_thread

signal.signal(signal.SIGINT, signal.default_int_handler)

idle = threading.Event()
taker = threading.Thread(target=idle.wait, daemon=True)  # a thread that takes signals, as tqdm's monitor does
taker.start()

def press():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    time.sleep(0.2)
    if sys.argv[1] == "process":
        os.kill(os.getpid(), signal.SIGINT)  # (to the process, as a terminal sends it)
    else:
        signal.pthread_kill(taker.ident, signal.SIGINT)  # (the kernel's choice, made for it)

threading.Thread(target=press, daemon=True).start()
start = time.perf_counter()
try:
    off_main_thread(lambda: time.sleep(5))
except KeyboardInterrupt:
    print(f"interrupted after {time.perf_counter() - start:.2f} s")
else:
    print("not interrupted")
"""


@pytest.mark.parametrize("to", ["process", "another thread"])
def test_ctrl_c_while_loading_interrupts_at_once(to: str) -> None:
    """A Ctrl-C ends the wait for the model at once, not when the load is done (a compile takes up to a minute):
    sent to the process, it reaches the main thread, as the loading thread blocks it; taken by another thread (the
    kernel may hand it to any thread that does not block it, and tqdm's monitor runs while a model loads), the main
    thread's wait wakes often enough to raise it (a join without a timeout slept on until the load was done)."""
    done = subprocess.run(
        [sys.executable, "-c", PRESS_CTRL_C, to.split()[-1]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:2] == ["interrupted", "after"] and float(words[2]) < 2, done.stdout


def record(msg: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, None) if error is not None else None
    return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, msg, (), exc_info)


def test_a_request_cancelled_at_shutdown_is_logged_in_one_line_not_a_traceback() -> None:
    quiet = QuietCancels()
    cancelled = record("Exception in ASGI application\n", asyncio.CancelledError())
    assert quiet.filter(cancelled)
    assert (cancelled.getMessage(), cancelled.levelname, cancelled.exc_info) == (CUT_OFF, "WARNING", None)
    lifespan = record("Traceback (most recent call last):\n  ...\nasyncio.exceptions.CancelledError\n")
    assert not quiet.filter(lifespan)
    failed = record("Exception in ASGI application\n", ValueError("a real fault"))
    assert quiet.filter(failed) and failed.exc_info is not None and failed.levelname == "ERROR"
    other = record("Traceback (most recent call last):\n  ...\nValueError: a real fault\n")
    assert quiet.filter(other)


def test_requests_still_running_when_the_grace_ends_are_told_the_server_stops(tiny_lm: Any) -> None:
    """Past the grace, a whole reply's request gets a 503 `server_stopping` body and a stream that error as its last
    event before [DONE]; neither a bare "Internal Server Error" text nor a stream cut mid-body (what uvicorn's own
    cancelling gives), and their engine streams are freed."""
    engine = make_engine(tiny_lm, delay=0.1)  # (a reply of 40 tokens takes 4 s)
    app = create_app(engine, tiny_lm, model_name=MODEL)
    grace = 0.5
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=grace + ENDING_S)  # fmt: skip
    server = ending_server(config, grace, app.state.moelane.shutdown)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 30)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/completions"
    # End-of-sequence banned: every reply runs its 40 tokens, past the grace. (Sampled, the tiny model ends some replies
    # within their first few tokens: those requests finish inside the grace, and rightly get their whole reply.)
    no_eos = {str(t): -100 for t in tiny_lm.eos_ids}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 40, "logit_bias": no_eos}
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(httpx.post, url, json=body, timeout=30)
        streamed = pool.submit(httpx.post, url, json={**body, "stream": True}, timeout=30)
        assert wait_until(lambda: engine.n_active == 2)
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()
        r, s = whole.result(), streamed.result()
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_stopping", r.text
    *_, error, done = [e for e in s.text.split("\n\n") if e]
    assert json.loads(error.removeprefix("data: "))["error"]["code"] == "server_stopping" and done == "data: [DONE]"
    assert engine.n_active == 0 and app.state.moelane.in_flight == 0
