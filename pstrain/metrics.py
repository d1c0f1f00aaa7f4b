"""Public façade: :mod:`pstrain._training.metrics` holds the implementation."""

from ._training.metrics import *  # noqa: F403
from ._training.metrics import __all__ as __all__
