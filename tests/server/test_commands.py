"""`moelane serve`'s flags: when the decode step is compiled."""

from __future__ import annotations

import socket

import pytest

from moelane.cli import build_parser, main
from moelane.server.commands import wants_compile


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
