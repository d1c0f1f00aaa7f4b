"""pstrain's channel to a task (``Channel``): typed requests over the authenticated stream,
for tools that talk to a running cluster."""

from ._transport.channels import *  # noqa: F403
from ._transport.channels import __all__ as __all__
