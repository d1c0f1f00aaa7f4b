"""Cluster descriptions: ``ClusterSpec`` and the resolvers (``TFConfigClusterResolver``,
``SimpleClusterResolver``, ``SlurmClusterResolver``)."""

from ._base.cluster import *  # noqa: F403
from ._base.cluster import __all__ as _spec
from ._base.resolvers import *  # noqa: F403
from ._base.resolvers import __all__ as _resolvers

__all__ = [*_spec, *_resolvers]
