"""Public façade: :mod:`pstrain._checkpoint.evaluator` holds the implementation."""

from ._checkpoint.evaluator import *  # noqa: F403
from ._checkpoint.evaluator import __all__ as __all__
