"""User-facing errors. The CLI turns any `MoelaneError` into one line on stderr and exit code 2; the server turns it
into an OpenAI-style error body. Internal invariants use `assert`, never these."""

import math
import operator


class MoelaneError(Exception):
    """A problem the user can fix: bad input, a bad model folder, an impossible setting."""


class ModelLoadError(MoelaneError):
    """The model folder is missing, incomplete or inconsistent."""


class InputError(MoelaneError):
    """A request that cannot be served as asked (prompt too long, bad sampling setting, ...)."""


class Unavailable(MoelaneError):
    """A part the model runs on has failed (a rank of a distributed run that died or stopped answering): requests
    cannot be served until it is restarted. The server answers 503 and says it is degraded."""


class PromptTooLong(InputError):
    """A prompt that does not fit the model's context (the server says `context_length_exceeded`)."""


def check_number(name: str, value: float, least: float, strict: bool = False) -> None:
    """ValueError unless `value` is a finite number >= `least` (> with `strict`), said as "`name` must be ..." (the
    CLI's `in_flags` names the flag instead)."""
    if not (math.isfinite(value) and (value > least if strict else value >= least)):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {least:g}, got {value}")


def integer(name: str, value: object) -> int:
    """`value` as a plain int (numpy and torch integers too); ValueError naming `name` for a bool, a float (even a
    whole one: 2.0 is a caller's mistake, not a count) or anything else."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r}")
