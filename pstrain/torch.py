"""Public façade: :mod:`pstrain._frameworks.torch` holds the implementation."""

from ._frameworks.torch import *  # noqa: F403
from ._frameworks.torch import __all__ as __all__
