"""Distributed values: one value per replica, and one per worker.

pstrain runs one replica per worker, so inside a closure a
:class:`PerReplica` holds one value; the types exist so that code written for
TF's strategies (``strategy.run`` then ``strategy.reduce``) runs unchanged.
:class:`PerWorkerValues` holds per-worker resources on the coordinator (one
iterator per worker); a closure that receives it gets its own worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._base.exports import expose

__all__ = ["DistributedValues", "PerReplica", "PerWorkerValues", "ValueContext"]


class DistributedValues:
    """Base of values that have one component per replica.

    >>> PerReplica((1, 2)).values
    (1, 2)
    """

    def __init__(self, values: Sequence[Any]) -> None:
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The value of each replica, in replica order."""
        return self._values

    def __repr__(self) -> str:
        inner = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{{inner}}}"


class PerReplica(DistributedValues):
    """One value per replica, as returned by ``strategy.run``."""


class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


class PerWorkerValues:
    """One value per worker, held on the coordinator (e.g. RemoteValues of
    per-worker iterators). Passed to ``schedule``, each closure receives the
    component of the worker it runs on.

    >>> PerWorkerValues([10, 11]).values
    (10, 11)
    """

    def __init__(self, values: Sequence[Any], resource_id: int | None = None) -> None:
        self._values = tuple(values)
        self._resource_id = resource_id

    @property
    def resource_id(self) -> int | None:
        """The per-worker resource these values stand for (None: plain values)."""
        return self._resource_id

    @property
    def values(self) -> tuple[Any, ...]:
        """The value on each worker, in worker order."""
        return self._values

    def __iter__(self) -> Any:
        raise TypeError(
            "iterate a per-worker dataset with iter(...) and pass the result to "
            "coordinator.schedule; its elements live on the workers"
        )

    def __repr__(self) -> str:
        return f"PerWorkerValues({len(self.values)} workers)"


expose(globals(), "pstrain", ["DistributedValues", "PerReplica", "PerWorkerValues", "ValueContext"])
