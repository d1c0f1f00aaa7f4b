"""Public façade: :mod:`pstrain._frameworks.jax` holds the implementation."""

from ._frameworks.jax import *  # noqa: F403
from ._frameworks.jax import __all__ as __all__
