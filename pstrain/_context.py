"""Where this process stands in the cluster: which worker it is, if any.

Set once by a worker server at start; read by ``get_current_worker_index()``
inside closures and dataset functions, whatever thread they run on.
"""

from __future__ import annotations

_worker_index: int | None = None


def set_worker_index(index: int | None) -> None:
    global _worker_index
    _worker_index = index


def worker_index() -> int | None:
    return _worker_index
