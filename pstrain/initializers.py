"""Public façade: :mod:`pstrain._formats.numerics.initializers` holds the implementation."""

from ._formats.numerics.initializers import *  # noqa: F403
from ._formats.numerics.initializers import __all__ as __all__
