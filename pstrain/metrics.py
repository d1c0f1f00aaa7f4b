"""Metrics whose state lives on the ps (Keras': ``Mean``, ``Sum``, ``Accuracy``,
``SparseCategoricalAccuracy``, ``AUC``), updated from any worker."""

from ._training.metrics import *  # noqa: F403
from ._training.metrics import __all__ as __all__
