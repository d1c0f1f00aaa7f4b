"""worker: the implementation is :mod:`pstrain.server.worker.executor`."""

from .executor import *  # noqa: F403
from .executor import __all__ as __all__
