"""``pstrain.partitioners``: how a strategy splits variables (TF's three partitioners).

>>> from pstrain.partitioners import FixedShardsPartitioner
>>> FixedShardsPartitioner(4)((3, 2), "float32")
[3, 1]
"""

from __future__ import annotations

from .sharding import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner"]
