"""Sparse helpers on numpy, compiled where it counts: ``unique`` and segment sums (TF's
``tf.unique`` and ``tf.math.unsorted_segment_sum``)."""

from ._variables.segments import *  # noqa: F403
from ._variables.segments import __all__ as __all__
