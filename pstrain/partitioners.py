"""How a variable is split into shards over the ps (TF's ``FixedShardsPartitioner``,
``MinSizePartitioner``, ``MaxSizePartitioner``)."""

from ._variables.partitioners import *  # noqa: F403
from ._variables.partitioners import __all__ as __all__
