"""Public façade: :mod:`pstrain._checkpoint.checkpoint` and :mod:`pstrain._checkpoint.manager`
hold the implementation."""

from ._checkpoint.checkpoint import *  # noqa: F403
from ._checkpoint.checkpoint import __all__ as _checkpoint_all
from ._checkpoint.manager import CheckpointManager

__all__ = [*_checkpoint_all, "CheckpointManager"]
