"""The exceptions pstrain raises, one tree rooted at :class:`PstrainError`.

::

    PstrainError
    ├── UnavailableError        (also ConnectionError)  a task cannot be reached
    ├── CancelledError                                  a closure was cancelled
    ├── ClosureInputError                               an input of a closure failed
    ├── ClosureAbortedError                             its worker died; rescheduled
    ├── InvalidArgumentError    (also ValueError)       bad dtype, shape, config ...
    │   └── WrongTaskError                              the task at an address is another
    ├── NotFoundError           (also LookupError)      unknown variable, function
    ├── AlreadyExistsError                              duplicate variable
    ├── AuthenticationError     (also PermissionError)  missing or wrong token
    ├── ProtocolError                                   malformed or oversized message
    ├── OutOfRangeError                                 an iterator ran out (TF's name)
    ├── FailedPreconditionError                         the state does not allow it now
    ├── PlacementChangedError                           the variable moved to another ps
    └── DeadlineExceededError   (also TimeoutError)     no answer in time

Where a meaning matches a builtin the class also derives from it, so callers
may catch either. :class:`CancelledError` deliberately does *not* derive from
``asyncio.CancelledError``: a cancelled closure is an outcome to report, not a
request to unwind the caller's task.

Errors cross the wire as an envelope (``type``, ``message``, ``traceback``,
``task``); :func:`from_envelope` rebuilds the matching class on the caller.
"""

from __future__ import annotations

from typing import Any

from .exports import expose

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "CancelledError",
    "ClosureAbortedError",
    "ClosureInputError",
    "DataLossError",
    "DeadlineExceededError",
    "DrainingError",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "NotFoundError",
    "OutOfRangeError",
    "PlacementChangedError",
    "ProtocolError",
    "PsRestartedError",
    "PstrainError",
    "ResourceExhaustedError",
    "UnavailableError",
    "WrongTaskError",
]


class ImportNeeded(Exception):
    """Internal, never raised to a user: decoding would import a module this process has not
    imported yet (a pickle naming ``torch``, say), and the decode may not import
    (``wire.decode_body(imports=False)``). Raised before anything is imported; the caller
    decodes the body again where an import can take its time."""


class PstrainError(Exception):
    """Base class of every error pstrain raises.

    ``task`` names the task where the error arose (``/job:ps/replica:0/task:1``)
    when it came from another process; ``remote_traceback`` holds that
    process's traceback text.

    >>> try:
    ...     raise NotFoundError("variable 'w' not found")
    ... except PstrainError as e:
    ...     print(type(e).__name__)
    NotFoundError
    """

    #: HTTP status used when this error travels as a reply.
    http_status = 500

    def __init__(
        self, message: str = "", *, task: str | None = None, remote_traceback: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.task = task
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> Any:
        return (_rebuild, (type(self), self.message, self.task, self.remote_traceback))


def _rebuild(cls: type, message: str, task: str | None, tb: str | None) -> PstrainError:
    return cls(message, task=task, remote_traceback=tb)


def restated(exc: PstrainError, message: str) -> PstrainError:
    """``exc`` again, of its class and from its task, saying ``message`` (what it meant to
    the operation that met it); raise it ``from exc``.

    >>> restated(UnavailableError("refused", task="ps1"), "the move was undone: refused")
    UnavailableError('the move was undone: refused')
    """
    out = _rebuild(type(exc), message, exc.task, exc.remote_traceback)
    out.__dict__.update({k: v for k, v in exc.__dict__.items() if k not in ("message", "task")})
    return out


class UnavailableError(PstrainError, ConnectionError):
    """A task (ps or worker) cannot be reached: refused, reset or silent."""

    http_status = 503


class PsRestartedError(UnavailableError):
    """A parameter server restarted (however quickly) and lost the variables it held:
    restore the latest checkpoint to continue. ``incarnation`` is its new one."""

    def __init__(self, message: str = "", *, incarnation: str | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.incarnation = incarnation


class DrainingError(UnavailableError):
    """A worker is leaving (``SIGTERM``, a spot machine's preemption notice): it finishes
    what it runs and takes nothing new; its refused closures go to other workers and no
    failure is counted."""


class CancelledError(PstrainError):
    """A closure was cancelled, usually because another closure failed first.

    Not a subclass of ``asyncio.CancelledError``.
    """

    http_status = 499


class ClosureInputError(PstrainError):
    """An input of a closure (a RemoteValue or per-worker resource) failed."""

    http_status = 400


class ClosureAbortedError(PstrainError):
    """A closure's worker was lost; the closure is put back and rerun."""

    http_status = 503


class InvalidArgumentError(PstrainError, ValueError):
    """A request or argument is malformed: wrong dtype, shape, config, ids."""

    http_status = 400


class WrongTaskError(InvalidArgumentError):
    """The task at an address is not the one the cluster spec names there (``actual``):
    the handshake binds the task dialled, so a spec that does not match the running tasks,
    or a connection relayed to another task, is refused at once."""

    def __init__(self, message: str, *, actual: str = "", **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.actual = actual


class NotFoundError(PstrainError, LookupError):
    """Something named does not exist: a variable, a function digest, a path."""

    http_status = 404


class AlreadyExistsError(PstrainError):
    """A variable with that name already exists on the ps."""

    http_status = 409


class AuthenticationError(PstrainError, PermissionError):
    """The cluster token is missing or wrong."""

    http_status = 401


class ProtocolError(PstrainError):
    """A message could not be decoded, or is larger than the configured limit."""

    http_status = 400


class OutOfRangeError(PstrainError):
    """A closure called ``next()`` on an exhausted iterator (TF: "End of sequence").

    A ``StopIteration`` cannot cross an ``await`` (Python turns it into a
    ``RuntimeError``), so workers report it as this error. Repeat datasets and
    schedule a fixed number of steps, as TF recommends.
    """

    http_status = 400


class FailedPreconditionError(PstrainError):
    """The system is not in the state the operation needs (TF's name): for example a delta
    checkpoint asked of a ps that restarted since the save it would extend."""

    http_status = 412


class PlacementChangedError(PstrainError):
    """A request reached a ps that no longer holds (or does not hold yet) a variable it
    names: the ps moved it (an elastic ps joined or left). Nothing of the request was
    applied. ``placement`` is the ps's placement map (which ps holds what, and the map's
    version); pstrain's clients adopt it and send the request again where it belongs, so
    user code sees this error only if the variable keeps moving past the retries."""

    http_status = 421  # Misdirected Request

    def __init__(self, message: str = "", *, placement: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.placement = placement


class ResourceExhaustedError(PstrainError):
    """A ps refused what would take it past a resource it was given (TF's name): its
    ``--memory-budget`` for a tiered table's rows, or the disk under ``--table-dir``.
    Nothing of the request was applied; the refusal is counted in the ps's statistics."""

    http_status = 507  # Insufficient Storage


class DataLossError(PstrainError):
    """Rows a ps held are lost (TF's name: unrecoverable data loss or corruption): a
    checkpoint file that a tiered restore linked into its tier was written in place since
    (pstrain never changes a checkpoint file once saved). The table must be restored
    again."""

    http_status = 500


class DeadlineExceededError(PstrainError, TimeoutError):
    """No answer arrived within the deadline."""

    http_status = 504


_BY_NAME: dict[str, type[PstrainError]] = {
    cls.__name__: cls
    for cls in (
        PstrainError,
        UnavailableError,
        DrainingError,
        CancelledError,
        ClosureInputError,
        ClosureAbortedError,
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        AuthenticationError,
        ProtocolError,
        OutOfRangeError,
        FailedPreconditionError,
        DeadlineExceededError,
        PlacementChangedError,
        ResourceExhaustedError,
        DataLossError,
    )
}


def to_envelope(
    exc: BaseException,
    task: str | None = None,
    traceback_text: str | None = None,
    pickled: bytes | None = None,
) -> dict[str, Any]:
    """The one shape an error travels in (an ERROR reply, a closure's failure, a resource
    that could not be built): its type's name, message, task, traceback and, where the
    receiver may unpickle (a closure's own exception), the pickled exception.

    >>> to_envelope(NotFoundError("no 'w'"), "/job:ps/replica:0/task:0")["type"]
    'NotFoundError'
    """
    envelope: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": str(exc) if not isinstance(exc, PstrainError) else exc.message,
        "traceback": traceback_text,
        "task": getattr(exc, "task", None) or task,
    }
    if pickled is not None:
        envelope["pickled"] = pickled
    placement = getattr(exc, "placement", None)
    if isinstance(exc, PlacementChangedError) and placement is not None:
        envelope["placement"] = placement
    return envelope


def from_envelope(env: dict[str, Any]) -> PstrainError:
    """Rebuild the pstrain error an envelope describes (unknown types -> base)."""
    cls = _BY_NAME.get(str(env.get("type")), PstrainError)
    message = str(env.get("message", ""))
    if cls is PstrainError and env.get("type") not in (None, "PstrainError"):
        message = f"{env.get('type')}: {message}"
    if cls is PlacementChangedError:
        placement = env.get("placement")
        return cls(
            message,
            task=env.get("task"),
            remote_traceback=env.get("traceback"),
            placement=placement if isinstance(placement, dict) else None,
        )
    return cls(message, task=env.get("task"), remote_traceback=env.get("traceback"))


def status_for(exc: BaseException) -> int:
    """HTTP status for an error raised while serving a request."""
    if isinstance(exc, PstrainError):
        return exc.http_status
    return 500


expose(globals(), "pstrain.errors")
