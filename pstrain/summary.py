"""Public façade: :mod:`pstrain._training.summary` holds the implementation."""

from ._training.summary import *  # noqa: F403
from ._training.summary import __all__ as __all__
