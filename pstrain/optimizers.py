"""Public façade: :mod:`pstrain._training.optimizers` holds the implementation."""

from ._training.optimizers import *  # noqa: F403
from ._training.optimizers import __all__ as __all__
