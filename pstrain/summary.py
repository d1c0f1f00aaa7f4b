"""Scalars for TensorBoard: ``pstrain.summary.scalar`` from closures and the coordinator,
written by a ``SummaryWriter``."""

from ._training.summary import *  # noqa: F403
from ._training.summary import __all__ as __all__
