"""Public façade: :mod:`pstrain._formats.initializers` holds the implementation."""

from ._formats.initializers import *  # noqa: F403
from ._formats.initializers import __all__ as __all__
