"""Public façade: :mod:`pstrain._variables.segments` holds the implementation."""

from ._variables.segments import *  # noqa: F403
from ._variables.segments import __all__ as __all__
