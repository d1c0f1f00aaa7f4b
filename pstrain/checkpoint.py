"""Public façade: :mod:`pstrain._checkpoint.checkpoint`, :mod:`pstrain._checkpoint.manager` and
:mod:`pstrain._checkpoint.offline` hold the implementation."""

from ._checkpoint.checkpoint import *  # noqa: F403
from ._checkpoint.checkpoint import __all__ as _checkpoint_all
from ._checkpoint.manager import CheckpointManager
from ._checkpoint.offline import load_variables

__all__ = [*_checkpoint_all, "CheckpointManager", "load_variables"]
