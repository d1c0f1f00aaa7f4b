"""Public façade: :mod:`pstrain._base.errors` holds the implementation."""

from ._base.errors import *  # noqa: F403
from ._base.errors import __all__ as __all__
