"""Public façade: :mod:`pstrain._training.data` holds the implementation."""

from ._training.data import *  # noqa: F403
from ._training.data import __all__ as __all__
