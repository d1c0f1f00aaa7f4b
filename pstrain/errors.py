"""The errors pstrain raises, under TF's names where TF has one (``NotFoundError``,
``UnavailableError`` ...); each has the HTTP status a server answers it with."""

from ._base.errors import *  # noqa: F403
from ._base.errors import __all__ as __all__
