"""Input pipelines: per-worker datasets and iterators.

``coordinator.create_per_worker_dataset(dataset_fn)`` runs ``dataset_fn`` on
every worker; ``iter()`` of the result makes one iterator per worker. Passed
to ``schedule``, they reach each closure as *that worker's* object, so
``next(iterator)`` inside a closure reads the worker's own stream. The
coordinator keeps each resource's recipe so that a worker that restarts gets
them rebuilt, in creation order, before it takes new closures.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import TYPE_CHECKING, Any

from .errors import ClosureInputError
from .remote_value import RemoteValue
from .values import PerWorkerValues

if TYPE_CHECKING:
    from .coordinator import ClusterCoordinator

from .dataset import Dataset

__all__ = ["Dataset", "PerWorkerDataset", "PerWorkerIterator"]


class ResourceSpec:
    """How to build one per-worker resource, and its RemoteValue on each worker."""

    def __init__(self, rid: int, kind: str, num_workers: int,
                 loop: asyncio.AbstractEventLoop | None, fields: dict[str, Any]) -> None:
        self.rid = rid
        self.kind = kind
        self.fields = fields
        self.rvs = [RemoteValue(loop) for _ in range(num_workers)]

    def request(self) -> dict[str, Any]:
        return {"rid": self.rid, "kind": self.kind, **self.fields}

    def built(self, index: int, error: dict[str, Any] | None) -> None:
        rv = self.rvs[index]
        if rv.done():
            rv._reset()
        if error is None:
            rv._set_value(_WorkerResource(self.rid, index))
        else:
            rv._set_error(ClosureInputError(
                f"Input has an error, the original exception is {error.get('type')}, error "
                f"message is {error.get('message')}", remote_traceback=error.get("traceback")))

    def abort(self, index: int) -> None:
        """The worker died: this resource is rebuilt when it is back."""
        self.rvs[index]._reset()


class _WorkerResource:
    """What a per-worker resource's RemoteValue holds on the coordinator: a reference."""

    def __init__(self, rid: int, worker: int) -> None:
        self.rid = rid
        self.worker = worker

    def __repr__(self) -> str:
        return f"<per-worker resource {self.rid} on worker {self.worker}>"


class PerWorkerDataset(PerWorkerValues):
    """The datasets made by ``dataset_fn`` on every worker.

    >>> # ds = coordinator.create_per_worker_dataset(lambda: range(100))
    >>> # it = iter(ds)
    >>> # coordinator.schedule(lambda it: next(it), args=(it,))
    """

    def __init__(self, coordinator: ClusterCoordinator, spec: ResourceSpec) -> None:
        super().__init__(spec.rvs)
        self._coordinator = coordinator
        self._rid = spec.rid
        self._spec = spec
        weakref.finalize(self, coordinator._drop_resource, spec.rid)

    def __iter__(self) -> PerWorkerIterator:  # type: ignore[override]
        spec = self._coordinator._new_resource(
            "iterator", of=self._rid, fn=self._spec.fields["fn"])
        return PerWorkerIterator(self._coordinator, spec)

    def build(self) -> PerWorkerDataset:
        """The per-worker datasets themselves, to pass to closures."""
        return self


class PerWorkerIterator(PerWorkerValues):
    """One iterator per worker; pass it to ``schedule`` and call ``next()`` in the closure."""

    def __init__(self, coordinator: ClusterCoordinator, spec: ResourceSpec) -> None:
        super().__init__(spec.rvs)
        self._rid = spec.rid
        weakref.finalize(self, coordinator._drop_resource, spec.rid)

    def __next__(self) -> Any:
        raise NotImplementedError(
            "Iterating over a per-worker iterator on the coordinator is not supported; pass it to "
            "coordinator.schedule and call next() inside the closure")

    def __iter__(self) -> PerWorkerIterator:  # type: ignore[override]
        return self
