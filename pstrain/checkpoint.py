"""Checkpoints: ``Checkpoint`` and ``CheckpointManager`` (TF's, with delta checkpoints),
``latest_checkpoint`` (TF's ``tf.train.latest_checkpoint``), and ``load_variables``,
``list_variables`` and ``load_variable`` to read a checkpoint without a cluster."""

from ._checkpoint.checkpoint import *  # noqa: F403
from ._checkpoint.checkpoint import __all__ as _checkpoint_all
from ._checkpoint.manager import CheckpointManager, latest_checkpoint
from ._checkpoint.offline import list_variables, load_variable, load_variables

__all__ = [
    *_checkpoint_all,
    "CheckpointManager",
    "latest_checkpoint",
    "list_variables",
    "load_variable",
    "load_variables",
]
