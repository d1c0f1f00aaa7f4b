"""The side-car evaluator: reads each new checkpoint and runs an evaluation script on it
(``pstrain serve --role evaluator``)."""

from ._checkpoint.evaluator import *  # noqa: F403
from ._checkpoint.evaluator import __all__ as __all__
