"""What the coordinator and a worker say about closures, shared by both sides.

* :class:`ClosureStatus`: how a closure ended, in each result a worker streams back
  (``records.ClosureResult``).
* :class:`ResourceRef`: stands for a per-worker resource (a dataset or an
  iterator) in a closure's arguments; the worker puts its own object there.
* :func:`exception_payload` / :func:`exception_from_payload`: a closure's
  exception as it travels (pickled when possible, always as text) and as it
  is raised again on the coordinator, with its own type and a note saying
  which task raised it.
"""

from __future__ import annotations

import enum
import traceback
from typing import Any

from ..._base.errors import OutOfRangeError, PstrainError, to_envelope

__all__ = [
    "CANCELLED",
    "ERROR",
    "FUNCTIONS_KEPT",
    "FUNCTION_BYTES_KEPT",
    "OK",
    "UNSENT",
    "ClosureStatus",
    "ResourceRef",
    "exception_from_payload",
    "exception_payload",
]


class ClosureStatus(enum.IntEnum):
    """How a closure ended; on the wire, its value."""

    OK = 0
    ERROR = 1
    CANCELLED = 2
    #: not run: the worker no longer holds its function (it keeps a bounded number); the
    #: coordinator sends the closure again with the function's bytes
    UNSENT = 3


OK, ERROR, CANCELLED, UNSENT = ClosureStatus  # (in the order of their values)

#: Closure functions travel pickled once, then by digest. The coordinator keeps the bytes
#: of this many (and at most ``FUNCTION_BYTES_KEPT`` of them) and counts each worker as
#: holding as many; a worker keeps twice as many, the oldest dropped first. So a loop that
#: makes a new function every step (``lambda: step(batch)``) holds a bounded set of them,
#: not all of them with what each captured.
FUNCTIONS_KEPT = 1024
FUNCTION_BYTES_KEPT = 64 << 20


class ResourceRef:
    """A per-worker resource in closure arguments, resolved on the worker.

    >>> ResourceRef(3)
    ResourceRef(3)
    """

    __slots__ = ("rid",)

    def __init__(self, rid: int) -> None:
        self.rid = rid

    def __reduce__(self) -> Any:
        return (ResourceRef, (self.rid,))

    def __repr__(self) -> str:
        return f"ResourceRef({self.rid})"


def exception_payload(exc: BaseException) -> dict[str, Any]:
    """An exception as it travels back: pickled when possible, always as text.

    >>> exception_payload(ValueError("bad"))["type"]
    'ValueError'
    """
    from . import pickling

    if isinstance(exc, (StopIteration, StopAsyncIteration)):
        # A StopIteration cannot be re-raised through an await: report it as TF does.
        stop = exc
        exc = OutOfRangeError(
            "End of sequence: a closure called next() on an exhausted "
            "iterator (repeat the dataset, or schedule fewer steps)"
        )
        exc.__traceback__ = stop.__traceback__
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled: bytes | None = pickling.dumps_object(exc)
    except Exception:
        pickled = None
    return to_envelope(exc, None, tb, pickled)


def exception_from_payload(payload: dict[str, Any], task: str) -> BaseException:
    """The exception a payload describes, rebuilt with its own type when it unpickles.

    >>> exc = exception_from_payload(exception_payload(KeyError("k")), "/job:worker/replica:0/task:0")
    >>> type(exc).__name__, exc.__notes__[0].splitlines()[0]
    ('KeyError', 'raised on /job:worker/replica:0/task:0; remote traceback:')
    """
    import cloudpickle

    exc: BaseException | None = None
    if payload.get("pickled"):
        try:
            exc = cloudpickle.loads(payload["pickled"])
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = PstrainError(
            f"{payload.get('type')}: {payload.get('message')}",
            task=task,
            remote_traceback=payload.get("traceback"),
        )
    if isinstance(exc, PstrainError):
        exc.task = exc.task or task
        exc.remote_traceback = exc.remote_traceback or payload.get("traceback")
    exc.add_note(f"raised on {task}; remote traceback:\n{payload.get('traceback', '')}")
    return exc
