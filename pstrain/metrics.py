"""Metrics whose state lives on the ps (Keras': ``Mean``, ``Sum``, ``Accuracy``,
``BinaryAccuracy``, ``SparseCategoricalAccuracy``, ``AUC``, ``Precision``, ``Recall``,
``BinaryCrossentropy``, ``MeanSquaredError``, ``RootMeanSquaredError``,
``MeanAbsoluteError``), updated from any worker."""

from ._training.metrics import *  # noqa: F403
from ._training.metrics import __all__ as __all__
