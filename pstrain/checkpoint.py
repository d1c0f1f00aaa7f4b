"""Public façade: :mod:`pstrain._checkpoint.checkpoint` holds the implementation."""

from ._checkpoint.checkpoint import *  # noqa: F403
from ._checkpoint.checkpoint import __all__ as __all__
