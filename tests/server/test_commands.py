"""`moelane serve`'s flags: when the decode step is compiled, which drafter it gets, and the one-line refusal."""

from __future__ import annotations

import pytest

from moelane.cli import build_parser, main
from moelane.server.commands import wants_compile


def serve_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "compiled"),
    [
        ((), True),  # all experts resident, drafter auto: compiled, drafter none
        (("--drafter", "none"), True),
        (("--drafter", "recall"), False),
        (("--expert-memory", "50%"), False),  # a store: eager
        (("--eager",), False),
        (("--compile", "on", "--expert-memory", "50%"), True),
    ],
)
def test_serve_compiles_where_it_can(argv: tuple[str, ...], compiled: bool) -> None:
    assert wants_compile(serve_args(*argv)) is compiled


def test_serve_refuses_compile_with_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--compile", "on", "--drafter", "copy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--drafter none" in err[0]
