"""Public façade: :mod:`pstrain._transport.rpc` holds the implementation."""

from ._transport.rpc import *  # noqa: F403
from ._transport.rpc import __all__ as __all__
