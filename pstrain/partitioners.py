"""Public façade: :mod:`pstrain._variables.partitioners` holds the implementation."""

from ._variables.partitioners import *  # noqa: F403
from ._variables.partitioners import __all__ as __all__
