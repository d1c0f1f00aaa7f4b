"""Checkpoints: ``Checkpoint`` and ``CheckpointManager`` (TF's, with delta checkpoints), and
``load_variables`` to read a checkpoint's variables without a cluster."""

from ._checkpoint.checkpoint import *  # noqa: F403
from ._checkpoint.checkpoint import __all__ as _checkpoint_all
from ._checkpoint.manager import CheckpointManager
from ._checkpoint.offline import load_variables

__all__ = [*_checkpoint_all, "CheckpointManager", "load_variables"]
