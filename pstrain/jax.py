"""JAX models whose parameters live on the ps: their steps read and update the variables,
and pooled lookups padded so that new bag lengths do not recompile."""

from ._frameworks.jax import *  # noqa: F403
from ._frameworks.jax import __all__ as __all__
