"""ps: the implementation is :mod:`pstrain.server.ps.handlers`."""

from .handlers import *  # noqa: F403
from .handlers import __all__ as __all__
