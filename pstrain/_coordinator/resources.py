"""Per-worker resources: what each worker must build before it runs closures.

``create_per_worker_dataset`` and ``iter()`` of its result register a
*resource* (a recipe: run ``dataset_fn``; make an iterator of dataset N).
The :class:`ResourceRegistry` keeps every live recipe and, per worker, which
ones still have to be built there. A worker that restarts (a new
incarnation) gets all of them rebuilt, in creation order, before it takes
new closures; a resource dropped on the coordinator (garbage collected) is
dropped on the workers.

No I/O here: a dispatcher asks what to build or drop and reports back.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from .._base.errors import ClosureInputError
from .remote_value import Outcome, RemoteValue

__all__ = ["ResourceRegistry", "ResourceSpec", "WorkerResource"]


class WorkerResource:
    """What a per-worker resource's RemoteValue holds on the coordinator: a reference."""

    def __init__(self, rid: int, worker: int) -> None:
        self.rid = rid
        self.worker = worker

    def __repr__(self) -> str:
        return f"<per-worker resource {self.rid} on worker {self.worker}>"


class ResourceSpec:
    """How to build one per-worker resource, and its outcome on each worker."""

    def __init__(
        self,
        rid: int,
        kind: str,
        num_workers: int,
        loop: asyncio.AbstractEventLoop | None,
        fields: dict[str, Any],
    ) -> None:
        self.rid = rid
        self.kind = kind
        self.fields = fields
        self.outcomes = [Outcome(loop) for _ in range(num_workers)]
        self.remote_values = [RemoteValue(o) for o in self.outcomes]

    def add_worker(self, loop: asyncio.AbstractEventLoop | None) -> None:
        outcome = Outcome(loop)
        self.outcomes.append(outcome)
        self.remote_values.append(RemoteValue(outcome))

    def request(self) -> dict[str, Any]:
        """The ``worker/resource`` request that builds it."""
        return {"rid": self.rid, "kind": self.kind, **self.fields}


class ResourceRegistry:
    """Every live per-worker resource, and what each worker still has to build or drop.

    >>> reg = ResourceRegistry(num_workers=2)
    >>> spec = reg.new("dataset", fn=list)
    >>> [s.rid for s in reg.to_build(0)], reg.to_build(1)[0] is spec
    ([1], True)
    >>> reg.built(0, spec, None); reg.to_build(0)
    []
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._specs: dict[int, ResourceSpec] = {}
        self._pending: list[deque[ResourceSpec]] = [deque() for _ in range(num_workers)]
        self._dropped: list[list[int]] = [[] for _ in range(num_workers)]
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, wake: Callable[[], None]) -> None:
        self._listeners.append(wake)

    def _wake(self) -> None:
        for wake in self._listeners:
            wake()

    def __len__(self) -> int:
        return len(self._specs)

    def add_worker(self) -> int:
        """A worker joined beyond the configured ones: it builds every live resource.
        Returns its index."""
        index = self.num_workers
        self.num_workers += 1
        for spec in self._specs.values():
            spec.add_worker(self.loop)
        self._pending.append(deque(self._specs.values()))
        self._dropped.append([])
        self._wake()
        return index

    def new(self, kind: str, **fields: Any) -> ResourceSpec:
        """Register a resource to build on every worker."""
        spec = ResourceSpec(next(self._ids), kind, self.num_workers, self.loop, fields)
        self._specs[spec.rid] = spec
        for pending in self._pending:
            pending.append(spec)
        self._wake()
        return spec

    def drop(self, rid: int) -> None:
        """The coordinator let go of resource ``rid``: workers drop it too."""
        spec = self._specs.pop(rid, None)
        if spec is None:
            return
        for w in range(self.num_workers):
            try:
                self._pending[w].remove(spec)
            except ValueError:
                self._dropped[w].append(rid)
        self._wake()

    # -- what a dispatcher does --------------------------------------------------------------------
    def to_build(self, worker: int) -> list[ResourceSpec]:
        """Resources still to build on ``worker``, in creation order."""
        return list(self._pending[worker])

    def take_dropped(self, worker: int) -> list[int]:
        """Ids to drop on ``worker``."""
        ids, self._dropped[worker] = self._dropped[worker], []
        return ids

    def built(self, worker: int, spec: ResourceSpec, error: dict[str, Any] | None) -> None:
        """``spec`` was built on ``worker`` (or failed with ``error``, a payload)."""
        try:
            self._pending[worker].remove(spec)
        except ValueError:
            pass
        outcome = spec.outcomes[worker]
        if outcome.done():
            outcome.reset()
        if error is None:
            outcome.set_value(WorkerResource(spec.rid, worker))
        else:
            outcome.set_error(
                ClosureInputError(
                    f"Input has an error, the original exception is {error.get('type')}, error "
                    f"message is {error.get('message')}",
                    remote_traceback=error.get("traceback"),
                )
            )

    def worker_lost(self, worker: int) -> None:
        """``worker`` is unreachable: its resources are unknown until it is back."""
        for spec in self._specs.values():
            spec.outcomes[worker].reset()

    def worker_restarted(self, worker: int) -> None:
        """``worker`` came back as a new process: build everything there again."""
        self._pending[worker] = deque(self._specs.values())
        self._dropped[worker] = []

    def worker_reconnected(self, worker: int) -> None:
        """``worker`` is the same process as before: what it built is still there."""
        pending = {id(s) for s in self._pending[worker]}
        for spec in self._specs.values():
            if id(spec) not in pending and not spec.outcomes[worker].done():
                spec.outcomes[worker].set_value(WorkerResource(spec.rid, worker))
