"""`moelane serve`'s flags: when the decode step is compiled."""

from __future__ import annotations

import pytest

from moelane.cli import build_parser
from moelane.server.commands import wants_compile


def serve_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "compiled"),
    [
        ((), True),  # all experts resident: compiled, whatever the drafter
        (("--drafter", "none"), True),
        (("--drafter", "recall"), True),
        (("--expert-memory", "50%"), False),  # a store: eager
        (("--eager",), False),
        (("--compile", "on", "--expert-memory", "50%"), True),
    ],
)
def test_serve_compiles_where_it_can(argv: tuple[str, ...], compiled: bool) -> None:
    assert wants_compile(serve_args(*argv)) is compiled
