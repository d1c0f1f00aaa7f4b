"""Public façade: :mod:`pstrain._base.cluster` holds the implementation."""

from ._base.cluster import *  # noqa: F403
from ._base.cluster import __all__ as __all__
