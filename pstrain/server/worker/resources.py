"""A worker's per-worker resources: datasets, and iterators safe from concurrent closures."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ..._base.errors import ClosureInputError, OutOfRangeError
from ..._formats.messages.closures import ResourceRef

__all__ = ["FailedResource", "LockedIterator", "dataset_name", "resolve"]


class FailedResource:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class LockedIterator:
    """A per-worker iterator; ``next()`` is safe from concurrent closures.

    At its end ``next()`` raises :class:`~pstrain.errors.OutOfRangeError` naming the
    dataset and the fix, as TF does (a ``StopIteration`` would not cross an ``await``:
    Python turns it into "coroutine raised StopIteration"), while ``for batch in it``
    ends its loop there, as TF's does: ``iter()`` gives a view whose end is the
    ``StopIteration`` a loop expects."""

    def __init__(self, iterator: Any, dataset: str = "the dataset", task: str = "") -> None:
        self._it = iterator
        self._dataset = dataset
        self._task = task
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[Any]:
        return _Loop(self._it, self._lock)

    def __next__(self) -> Any:
        with self._lock:
            try:
                return next(self._it)
            except StopIteration:
                raise OutOfRangeError(
                    f"End of sequence: the per-worker iterator of {self._dataset} on {self._task} "
                    "is exhausted. Repeat the dataset (.repeat() on a pstrain.data.Dataset, or "
                    "itertools.cycle) and schedule a fixed number of steps, as TF recommends",
                    task=self._task,
                ) from None

    def get_next(self) -> Any:
        """TF's spelling of ``next(it)``."""
        return next(self)


class _Loop:
    """A ``for`` loop over a per-worker iterator: the same elements, under the same lock,
    ending with ``StopIteration``."""

    __slots__ = ("_it", "_lock")

    def __init__(self, iterator: Any, lock: threading.Lock) -> None:
        self._it = iterator
        self._lock = lock

    def __iter__(self) -> _Loop:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return next(self._it)


def dataset_name(fn: Any) -> str:
    """How an error names a dataset: ``dataset_fn`` 'make_data' (what the user wrote)."""
    inner = getattr(fn, "fn", None) or getattr(fn, "value", None) or fn
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"dataset_fn {name!r}" if callable(inner) else f"the dataset {name!r}"


def resolve(obj: Any, resources: dict[int, Any], index: int) -> Any:
    """``obj`` with each :class:`ResourceRef` in it (in tuples, lists and dicts) replaced by
    that resource of worker ``index``; ClosureInputError for one missing or failed."""
    if isinstance(obj, ResourceRef):
        res = resources.get(obj.rid)
        if res is None:
            raise ClosureInputError(f"per-worker resource {obj.rid} does not exist on worker {index}")
        if isinstance(res, FailedResource):
            raise ClosureInputError(
                f"Input has an error, the original exception is {type(res.error).__name__}, "
                f"error message is {res.error}"
            )
        return res
    if type(obj) is tuple:
        return tuple(resolve(x, resources, index) for x in obj)
    if type(obj) is list:
        return [resolve(x, resources, index) for x in obj]
    if type(obj) is dict:
        return {k: resolve(v, resources, index) for k, v in obj.items()}
    return obj
