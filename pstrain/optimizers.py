"""Optimizers applied on the ps where the variables live (Keras': SGD, Adagrad,
row-wise Adagrad, Adam, AdamW, RMSprop, FTRL), and their learning-rate schedules."""

from ._training.optimizers import *  # noqa: F403
from ._training.optimizers import __all__ as __all__
