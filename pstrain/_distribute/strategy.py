"""ParameterServerStrategy: where variables live and how replicas combine.

The strategy knows the cluster and owns the channels to it. Variables
created in its :meth:`~ParameterServerStrategy.scope` are placed on the ps
by its :class:`~pstrain._variables.placement.Placement` (round-robin, colocation,
partitioning, batched creation sent before anything uses them:
:meth:`~ParameterServerStrategy.flush`). ``run``/``reduce``/``gather`` give
TF's replica API with one replica per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .._base.cluster import ClusterSpec, validate_ps_cluster
from .._base.context import in_closure
from .._base.errors import InvalidArgumentError
from .._base.exports import expose, internal
from .._base.resolvers import ClusterResolver
from .._transport.channels import ChannelPool
from .._variables.arrays import creator_scope
from .._variables.placement import Placement
from .distribution import (
    ReduceOp,
    ReplicaContext,
    current_replica,
    enter_strategy,
    exit_strategy,
    map_replicas,
    reduce_structure,
    replica_scope,
)
from .extended import StrategyExtended
from .input_distribution import DistributedDataset, InputContext, InputOptions
from .values import DistributedValues, PerReplica, ValueContext


class _Coordinator(Protocol):
    """What the strategy knows of its ClusterCoordinator (which imports this module)."""

    closed: bool


logger = logging.getLogger(__name__)

__all__ = ["ParameterServerStrategy"]

_USAGE_WARNING = (
    "A `ParameterServerStrategy` method (%s) is invoked without using "
    "`ClusterCoordinator.schedule`. If you are not tracing a function for "
    "`ClusterCoordinator.schedule`, this runs on the coordinator, not on a worker."
)


class _Scope:
    """``strategy.scope()``: both ``with`` and ``async with`` (which also flushes)."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self._strategy = strategy
        self._scopes: list[tuple[Any, contextlib.AbstractContextManager[None]]] = []

    def __enter__(self) -> ParameterServerStrategy:
        token = enter_strategy(self._strategy)
        scope = creator_scope(self._strategy.placement)
        scope.__enter__()
        self._scopes.append((token, scope))
        return self._strategy

    def __exit__(self, *exc: Any) -> None:
        token, scope = self._scopes.pop()
        scope.__exit__(*exc)
        exit_strategy(token)

    async def __aenter__(self) -> ParameterServerStrategy:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__(*exc)
        if exc[0] is None:
            await self._strategy.flush()


class ParameterServerStrategy:
    """Variables on parameter servers, computation on workers.

    ::

        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            w = pstrain.Variable(np.zeros((784, 10), np.float32), name="w")
    """

    __pstrain_opaque__ = True  # a checkpoint does not walk into it (object_graph)

    def __init__(
        self,
        cluster_resolver: ClusterResolver,
        variable_partitioner: Callable[..., Sequence[int]] | None = None,
    ) -> None:
        if not callable(getattr(type(cluster_resolver), "cluster_spec", None)):  # no property run
            raise InvalidArgumentError(
                "ParameterServerStrategy needs a cluster resolver (pstrain.TFConfigClusterResolver"
                f"(), SimpleClusterResolver(...), a LocalCluster's .resolver), got {cluster_resolver!r}"
            )
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise InvalidArgumentError(
                "variable_partitioner must be a partitioner (a function of "
                "shape and dtype, as pstrain.partitioners' are), got "
                f"{variable_partitioner!r}"
            )
        spec = cluster_resolver.cluster_spec()
        validate_ps_cluster(spec)
        task_type = getattr(cluster_resolver, "task_type", None)
        if task_type not in (None, "chief", "ps", "worker", "evaluator"):
            raise InvalidArgumentError(f"Unrecognized task_type: {task_type}")
        channels = ChannelPool(
            spec,
            getattr(cluster_resolver, "token", None),
            ssl_context=getattr(cluster_resolver, "ssl_context", None),
        )
        self._init_state(
            cluster_resolver,
            variable_partitioner,
            spec.num_tasks("ps"),
            spec.num_tasks("worker"),
            channels,
            _namespace(self, spec),
        )

    def _init_state(
        self,
        resolver: ClusterResolver | None,
        partitioner: Any,
        num_ps: int,
        num_workers: int,
        channels: ChannelPool | None,
        namespace: str = "",
    ) -> None:
        """State shared by the coordinator's strategy and its copy on a worker."""
        self._cluster_resolver = resolver
        self._variable_partitioner = partitioner
        self._num_ps = num_ps
        self._num_workers = num_workers
        self._channels = channels  # None on a worker: the closure's channels
        self._placement = Placement(num_ps, channels, partitioner, namespace=namespace)
        self._coordinator: _Coordinator | None = None
        self._warned_usage = False
        self._extended = StrategyExtended(self)

    # -- properties --------------------------------------------------------------------------
    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The resolver this strategy was made from (None for a closure's copy on a worker)."""
        return self._cluster_resolver

    @property
    def extended(self) -> StrategyExtended:
        """:class:`StrategyExtended`: placement details and lower-level updates."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients combine in one step: 1 (each worker steps alone)."""
        return 1

    @property
    def num_ps(self) -> int:
        """The number of parameter servers in the cluster."""
        return self._num_ps

    @property
    def num_workers(self) -> int:
        """The number of workers in the cluster."""
        return self._num_workers

    @property
    @internal
    def placement(self) -> Placement:
        """Where this strategy's variables go (names, round-robin, colocation, creation)."""
        return self._placement

    @property
    @internal
    def channels(self) -> ChannelPool:
        """The channels to the cluster's tasks (on the coordinator)."""
        if self._channels is None:
            raise InvalidArgumentError(
                "this strategy was captured by a closure; it has no channels of its own on a worker"
            )
        return self._channels

    @property
    def cluster_spec(self) -> ClusterSpec:
        """The cluster the strategy was built on, as a :class:`ClusterSpec`."""
        return self.channels.cluster_spec

    @property
    @internal
    def coordinator(self) -> _Coordinator | None:
        """The ClusterCoordinator of this strategy, if one was made and is open."""
        return self._coordinator

    @internal
    def attach_coordinator(self, coordinator: _Coordinator) -> None:
        """Called by ``ClusterCoordinator(strategy)``: one coordinator per strategy."""
        self._coordinator = coordinator

    @internal
    def worker_joined(self) -> None:
        """Called by the coordinator when a worker joins beyond the configured ones."""
        self._num_workers += 1

    @internal
    def detach_coordinator(self, coordinator: _Coordinator) -> None:
        """Forget ``coordinator`` (its ``close()`` calls this): another may be made for the strategy."""
        if self._coordinator is coordinator:
            self._coordinator = None

    def scope(self) -> _Scope:
        """Make variables created inside live on the ps (``with`` or ``async with``)."""
        return _Scope(self)

    async def flush(self) -> None:
        """Send every pending variable creation (one request per ps, concurrently), and
        create every dynamic table on the ps that hold it, where this loop has not yet
        (else a table is created on each ps by its first use): from then on each ps knows
        it, and its serving feed answers 412 until a save, not 404."""
        await self._placement.ensure_created()
        await asyncio.gather(*(t.ensure_created() for t in list(self._placement.tables.values())))

    # -- replica API -------------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Call ``fn`` as the replica of this worker, inside this strategy's scope;
        awaitable for a coroutine function. ``options`` (TF's ``RunOptions``) has no effect."""
        if not isinstance(args, (list, tuple)):
            raise InvalidArgumentError(
                f"strategy.run: args must be a list or a tuple, got {type(args).__name__}"
            )
        self._warn_outside_schedule("run")
        n = self.num_replicas_in_sync
        args = tuple(self._replica_value(a, n) for a in args)
        kwargs = {k: self._replica_value(v, n) for k, v in (kwargs or {}).items()}
        with replica_scope(ReplicaContext(self)), creator_scope(self._placement):
            result = fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return _in_replica(self, result)
        return result

    def _warn_outside_schedule(self, method: str) -> None:
        """TF's usage warning: run/reduce on the coordinator, not in a scheduled closure."""
        if self._channels is not None and not in_closure() and not self._warned_usage:
            self._warned_usage = True
            logger.warning(_USAGE_WARNING, method)

    @staticmethod
    def _replica_value(value: Any, replicas: int) -> Any:
        if isinstance(value, DistributedValues):
            if len(value.values) != replicas:
                raise InvalidArgumentError(
                    f"strategy.run: a {type(value).__name__} with {len(value.values)} parts, for "
                    f"{replicas} replica(s) in sync (one per worker)"
                )
            return value.values[0]
        return value

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine a per-replica ``value`` (and along ``axis`` within each, if given); a
        nested structure of values leaf by leaf, as TF's."""
        op = ReduceOp.parse(reduce_op)
        self._warn_outside_schedule("reduce")
        return reduce_structure(op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the per-replica components of ``value`` along ``axis`` (a nested
        structure leaf by leaf, as TF's).

        Cross-replica context only; components must have a rank of at least 1 and the
        same shape except along ``axis`` (TF's rules).
        """
        if current_replica() is not None:
            raise InvalidArgumentError(
                "strategy.gather can only be called in the cross-replica context (outside strategy.run)"
            )
        return map_replicas(value, lambda replicas: _gathered(replicas, axis))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The per-replica components of ``value`` as a tuple."""
        if isinstance(value, DistributedValues):
            return value.values
        return (value,)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> PerReplica:
        """Call ``value_fn`` once per replica with its :class:`ValueContext`."""
        n = self.num_replicas_in_sync
        return PerReplica([value_fn(ValueContext(i, n)) for i in range(n)])

    # -- input -------------------------------------------------------------------------------
    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> DistributedDataset:
        """``dataset`` distributed over the replicas: one replica per worker, so its elements
        are unchanged (batches keep the global batch size). Pass it, or a function returning
        it, to ``coordinator.create_per_worker_dataset``."""
        return DistributedDataset(dataset, options=options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """A dataset made by ``dataset_fn(InputContext)`` where it is iterated (on each worker
        inside ``create_per_worker_dataset``); the context has one input pipeline per worker."""
        context = InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=self.num_replicas_in_sync
        )
        return DistributedDataset(dataset_fn=dataset_fn, context=context, options=options)

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(ps={self._num_ps}, workers={self._num_workers})"

    def __reduce__(self) -> Any:
        # Captured by a closure: on the worker it becomes a strategy bound to the worker's
        # channels (run/reduce/gather/extended work; creating variables does not).
        return (_worker_strategy, (self._num_ps, self._num_workers, self._variable_partitioner))


#: The live strategies of this process, by the ps addresses of their cluster.
_LIVE: dict[tuple[str, ...], weakref.WeakSet[ParameterServerStrategy]] = {}


def _namespace(strategy: ParameterServerStrategy, spec: ClusterSpec) -> str:
    """ "" for the only live strategy on a cluster; ``strategy_<n>/`` for a second one made
    while the first lives (its variables must not collide with the first's on the ps)."""
    live = _LIVE.setdefault(tuple(spec.job_tasks("ps")), weakref.WeakSet())
    taken = {s.placement.namespace for s in live}
    live.add(strategy)
    n = 0
    while (f"strategy_{n}/" if n else "") in taken:
        n += 1
    return f"strategy_{n}/" if n else ""


def _worker_strategy(num_ps: int, num_workers: int, partitioner: Any) -> ParameterServerStrategy:
    self = object.__new__(ParameterServerStrategy)
    self._init_state(None, partitioner, num_ps, num_workers, None)
    return self


async def _in_replica(strategy: ParameterServerStrategy, coro: Any) -> Any:
    with replica_scope(ReplicaContext(strategy)), creator_scope(strategy.placement):
        return await coro


def _gathered(replicas: list[Any], axis: int) -> Any:
    """One leaf's per-replica values concatenated along ``axis`` (TF's checks first)."""
    parts = [np.asarray(v) for v in replicas]
    rank = parts[0].ndim
    if rank == 0:
        raise InvalidArgumentError(
            "strategy.gather: components must have a rank of at least 1 (expand their dims first)"
        )
    if not -rank <= axis < rank:
        raise InvalidArgumentError(f"strategy.gather: axis {axis} is out of range for rank {rank}")
    ax = axis % rank
    for p in parts[1:]:
        if (
            p.ndim != rank
            or p.shape[:ax] + p.shape[ax + 1 :] != parts[0].shape[:ax] + parts[0].shape[ax + 1 :]
        ):
            raise InvalidArgumentError(
                f"strategy.gather: shapes {parts[0].shape} and {p.shape} differ outside axis {axis}"
            )
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


expose(globals(), "pstrain", ["ParameterServerStrategy"])
