"""A scheduled closure: its function (pickled once), arguments, outcome, and the
RemoteValues and per-worker values among its arguments, resolved for the worker that
runs it. Sans-I/O, like the queue that holds closures (``scheduling.py``)."""

from __future__ import annotations

from typing import Any

from .._base.errors import CancelledError, ClosureInputError, InvalidArgumentError
from .._distribute.values import PerWorkerValues
from .._formats.messages.closures import ResourceRef
from .per_worker import ResourceValues
from .remote_value import Outcome, RemoteValue

__all__ = ["Closure", "check_call", "scan_inputs"]


def scan_inputs(obj: Any, inputs: list[RemoteValue]) -> bool:
    """Does ``obj`` hold per-worker or remote values (so it must be rewritten per worker)?

    RemoteValues found are appended to ``inputs``.

    >>> scan_inputs((1, [2, {"a": 3}]), [])
    False
    """
    if isinstance(obj, RemoteValue):
        inputs.append(obj)
        return True
    if isinstance(obj, PerWorkerValues):
        return True
    if type(obj) is tuple or type(obj) is list:
        found = False
        for x in obj:
            found = scan_inputs(x, inputs) or found
        return found
    if type(obj) is dict:
        found = False
        for x in obj.values():
            found = scan_inputs(x, inputs) or found
        return found
    return False


class Closure:
    """One scheduled call: the function (pickled once), its arguments and its outcome."""

    __slots__ = (
        "cid",
        "fn",
        "digest",
        "pickled",
        "args",
        "kwargs",
        "outcome",
        "walk",
        "inputs",
        "worker",
        "once_key",
        "resent",
    )

    def __init__(
        self,
        cid: int,
        fn: Any,
        digest: bytes,
        pickled: bytes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outcome: Outcome,
        walk: bool = False,
        inputs: list[RemoteValue] | None = None,
        once_key: str | None = None,
    ) -> None:
        self.cid = cid
        self.fn = fn
        self.digest = digest
        self.pickled = pickled
        self.args = args
        self.kwargs = kwargs
        self.outcome = outcome
        self.walk = walk  # do the arguments hold per-worker or remote values?
        self.inputs = inputs or []
        self.worker: int | None = None  # the worker it is in flight on
        self.once_key = once_key  # exactly-once: the key its updates carry, attempt after attempt
        self.resent = 0  # times a worker answered UNSENT (it had dropped the function)

    def inputs_ready(self) -> bool:
        return not self.inputs or all(rv.done() for rv in self.inputs)

    def input_error(self) -> ClosureInputError | None:
        """The error of an input that failed, if one has."""
        for rv in self.inputs:
            if rv.done():
                try:
                    _ready_value(rv)
                except ClosureInputError as exc:
                    return exc
        return None

    def cancel_error(self, message: str) -> BaseException:
        """What this closure fails with when it is cancelled: why its input failed, if one did."""
        return self.input_error() or CancelledError(message)

    def arguments_for(self, worker: int) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
        """``(args, kwargs, has_refs)`` as worker ``worker`` gets them.

        Per-worker values become that worker's part (a :class:`ResourceRef`
        for a per-worker resource); RemoteValues become their values. Raises
        :class:`ClosureInputError` if an input failed.
        """
        if not self.walk:
            return self.args, self.kwargs, False
        args, refs = _substitute(self.args, worker)
        kwargs, kw_refs = _substitute(self.kwargs, worker)
        return args, kwargs, refs or kw_refs


def _substitute(obj: Any, index: int) -> tuple[Any, bool]:
    if isinstance(obj, ResourceValues):  # a per-worker dataset or iterator
        return obj.ref(index), True
    if isinstance(obj, PerWorkerValues):
        rid = obj.resource_id
        if rid is not None:
            return ResourceRef(rid), True
        if index >= len(obj.values):
            raise InvalidArgumentError(
                f"a PerWorkerValues of {len(obj.values)} values was given to a closure that runs "
                f"on worker {index}, a worker that joined later: build per-worker values with "
                "coordinator.create_per_worker_dataset, which covers joining workers"
            )
        return _substitute(obj.values[index], index)
    if isinstance(obj, RemoteValue):
        if not obj.done():
            raise ClosureInputError(
                "Input is not ready: a RemoteValue input must resolve before its consumer is sent"
            )
        return _ready_value(obj), False
    if type(obj) is tuple or type(obj) is list:
        items = [_substitute(x, index) for x in obj]
        out = [x for x, _ in items]
        return (tuple(out) if type(obj) is tuple else out), any(r for _, r in items)
    if type(obj) is dict:
        items2 = {k: _substitute(v, index) for k, v in obj.items()}
        return {k: x for k, (x, _) in items2.items()}, any(r for _, r in items2.values())
    return obj, False


def _ready_value(rv: RemoteValue) -> Any:
    """The value of a resolved RemoteValue, without a loop (its await returns at once)."""
    gen = rv.__await__()
    try:
        next(gen)
    except StopIteration as stop:  # resolved: the generator returns at once
        return stop.value
    except ClosureInputError:
        raise  # already says which input failed and why
    except BaseException as exc:
        raise ClosureInputError(
            f"Input has an error, the original exception is {type(exc).__name__}, error message is {exc}"
        ) from exc
    gen.close()  # pragma: no cover - done() said it was resolved
    raise ClosureInputError("Input is not ready")  # pragma: no cover


def check_call(fn: Any, args: Any, kwargs: Any) -> None:
    """TypeError, as calling it would raise, for what ``schedule`` cannot run: ``fn`` not
    callable, ``args`` not a tuple or a list, ``kwargs`` not a dict."""
    if not callable(fn):
        raise TypeError(
            f"schedule needs a callable (a function or coroutine function), got {type(fn).__name__}"
        )
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, (dict, type(None))):
        raise TypeError(
            f"schedule: args must be a tuple or a list and kwargs a dict, got "
            f"{type(args).__name__} and {type(kwargs).__name__}"
        )
