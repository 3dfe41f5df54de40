"""moelane: run Mixture-of-Experts models that do not fit in fast memory, and serve them to many clients at once."""

from moelane.loading import load
from moelane.model.lm import LM

__all__ = ["LM", "load"]
