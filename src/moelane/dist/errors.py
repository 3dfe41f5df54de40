"""The errors of a distributed run."""

from __future__ import annotations

from moelane.errors import MoelaneError, Unavailable


class RankFailure(Unavailable):
    """A rank died or stopped answering within the timeout: the run cannot compute its experts any more."""


class RankMismatch(MoelaneError):
    """The ranks were started with different models or settings (refused at rendezvous)."""


class RankError(MoelaneError):
    """A rank could not compute its share of one pass (the error is its own; the ranks stay in step)."""
