"""User-facing errors. The CLI turns any `MoelaneError` into one line on stderr and exit code 2; the server turns it
into an OpenAI-style error body. Internal invariants use `assert`, never these."""


class MoelaneError(Exception):
    """A problem the user can fix: bad input, a bad model folder, an impossible setting."""


class ModelLoadError(MoelaneError):
    """The model folder is missing, incomplete or inconsistent."""


class InputError(MoelaneError):
    """A request that cannot be served as asked (prompt too long, bad sampling setting, ...)."""
