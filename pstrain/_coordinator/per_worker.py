"""Per-worker datasets and iterators: one input pipeline on every worker.

``coordinator.create_per_worker_dataset(dataset_fn)`` runs ``dataset_fn`` on
every worker; ``iter()`` of the result makes one iterator per worker. Passed
to ``schedule``, they reach each closure as *that worker's* object, so
``next(iterator)`` inside a closure reads the worker's own stream. The recipes
live in a :class:`~pstrain._coordinator.resources.ResourceRegistry`, so a worker that
restarts gets them rebuilt before it takes new closures.
"""

from __future__ import annotations

import weakref
from typing import Any

from .._base.errors import InvalidArgumentError
from .._distribute.values import PerWorkerValues
from .._formats.messages.closures import ResourceRef
from .._formats.messages.pickling import send_modules_by_value
from .._variables.arrays import creator_scope
from .resources import ResourceRegistry, ResourceSpec

__all__ = ["PerWorkerDataset", "PerWorkerIterator", "ResourceValues", "as_dataset_fn"]


class _Constant:
    """A dataset given as a value: every worker gets (a copy of) it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


class _NoVariables:
    """Where a dataset is built, creating a variable is refused (TF's rule)."""

    def create_variable(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError("Creating variables in `dataset_fn` is not allowed.")

    issued = created_upto = 0

    async def ensure_created(self) -> None:
        return None


class _DatasetFn:
    """``dataset_fn`` run with variable creation refused."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self) -> Any:
        with creator_scope(_NoVariables()):
            return self.fn()


def as_dataset_fn(dataset_fn: Any) -> Any:
    """``dataset_fn`` as a function (an iterable given as a value becomes a constant one)
    that may not create variables."""
    if callable(dataset_fn) and not hasattr(dataset_fn, "__iter__"):
        send_modules_by_value(dataset_fn)  # as a scheduled function's: workers need not have them
        return _DatasetFn(dataset_fn)
    if not hasattr(dataset_fn, "__iter__"):
        raise TypeError(
            "create_per_worker_dataset needs a function returning a dataset (any "
            f"iterable) or an iterable, got {type(dataset_fn).__name__}"
        )
    return _Constant(dataset_fn)


class ResourceValues(PerWorkerValues):
    """Per-worker values of a resource: a worker that joins later adds its value."""

    def __init__(self, spec: ResourceSpec) -> None:
        super().__init__((), resource_id=spec.rid)
        self._rid = spec.rid
        self._live = spec.remote_values
        self._outcomes = spec.outcomes

    def ref(self, worker: int) -> ResourceRef:
        """What a closure sent to ``worker`` carries for it; raises the error of its build
        there, if that failed (the worker then holds nothing under the ref)."""
        if worker < len(self._outcomes) and self._outcomes[worker].failed():
            self._outcomes[worker].result()
        return ResourceRef(self._rid)

    @property
    def values(self) -> tuple[Any, ...]:
        return tuple(self._live)


class PerWorkerDataset(ResourceValues):
    """The datasets made by ``dataset_fn`` on every worker.

    Made by the coordinator::

        ds = coordinator.create_per_worker_dataset(lambda: range(100))
        it = iter(ds)
        coordinator.schedule(lambda it: next(it), args=(it,))
    """

    def __init__(self, registry: ResourceRegistry, spec: ResourceSpec) -> None:
        super().__init__(spec)
        self._registry = registry
        self._fn = spec.fields["fn"]
        weakref.finalize(self, registry.drop, spec.rid)

    def __iter__(self) -> PerWorkerIterator:
        spec = self._registry.new("iterator", of=self.resource_id, fn=self._fn)
        return PerWorkerIterator(self._registry, spec)

    def build(self) -> PerWorkerDataset:
        """The per-worker datasets themselves, to pass to closures."""
        return self


class PerWorkerIterator(ResourceValues):
    """One iterator per worker; pass it to ``schedule`` and call ``next()`` in the closure."""

    def __init__(self, registry: ResourceRegistry, spec: ResourceSpec) -> None:
        super().__init__(spec)
        weakref.finalize(self, registry.drop, spec.rid)

    def __next__(self) -> Any:
        raise NotImplementedError(
            "Iterating over a per-worker iterator on the coordinator is not supported; pass it to "
            "coordinator.schedule and call next() inside the closure"
        )

    def __iter__(self) -> PerWorkerIterator:
        return self
