"""moelane: run Mixture-of-Experts models that do not fit in fast memory, and serve them to many clients at once."""

from moelane.model.lm import LM
from moelane.model.load import load

__all__ = ["LM", "load"]
