"""Datasets distributed by a strategy: TF's ``DistributedDataset``, ``InputContext``, ``InputOptions``.

With one replica per worker (pstrain's model, as TF's parameter-server
strategy on CPU workers), distributing a dataset changes no element: a
:class:`DistributedDataset` yields its dataset's elements as they are, and
its ``element_spec`` is the dataset's. What it adds is *where* the dataset is
built: passed to ``coordinator.create_per_worker_dataset`` (directly, or made
inside the ``dataset_fn`` as TF's tutorial does), it is built on every
worker, and ``distribute_datasets_from_function`` calls its function there
with an :class:`InputContext`::

    def dataset_fn(ctx: pstrain.InputContext):
        batch = ctx.get_per_replica_batch_size(64)
        return pstrain.data.Dataset.from_tensor_slices(xs).shuffle(1024).batch(batch).repeat()

    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn))

As in TF's parameter-server strategy, the context says ``num_input_pipelines=1``
and ``input_pipeline_id=0`` on every worker (no synchronisation beyond a
worker); shard by worker with ``pstrain.get_current_worker_index()`` if needed.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

from .._base.errors import InvalidArgumentError
from .._base.exports import expose

__all__ = ["DistributedDataset", "InputContext", "InputOptions", "InputReplicationMode"]


class InputReplicationMode(enum.Enum):
    """How input is replicated: one pipeline per worker (the only mode here, as TF)."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class InputOptions:
    """TF's options for distributing a dataset. Accepted and kept; with one CPU replica per
    worker none changes what a worker reads (there is no device to prefetch to).
    ``PER_REPLICA`` replication is refused, as TF refuses it for this strategy."""

    def __init__(
        self,
        experimental_fetch_to_device: bool | None = None,
        experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device: bool = False,
        experimental_per_replica_buffer_size: int = 1,
        experimental_prefetch_to_device: bool | None = None,
    ) -> None:
        if experimental_replication_mode is not InputReplicationMode.PER_WORKER:
            raise InvalidArgumentError(
                "InputReplicationMode.PER_REPLICA is not supported by "
                "ParameterServerStrategy (one input pipeline per worker)"
            )
        if experimental_place_dataset_on_device and (
            experimental_fetch_to_device or experimental_prefetch_to_device
        ):
            raise InvalidArgumentError(
                "`experimental_place_dataset_on_device` can not be set to True "
                "when experimental_fetch_to_device is True"
            )
        if experimental_per_replica_buffer_size < 1:
            raise InvalidArgumentError("experimental_per_replica_buffer_size must be >= 1")
        fetch = experimental_fetch_to_device
        if fetch is None:
            fetch = True if experimental_prefetch_to_device is None else experimental_prefetch_to_device
        self.experimental_fetch_to_device = fetch
        self.experimental_replication_mode = experimental_replication_mode
        self.experimental_place_dataset_on_device = experimental_place_dataset_on_device
        self.experimental_per_replica_buffer_size = experimental_per_replica_buffer_size

    def __repr__(self) -> str:
        return (
            f"InputOptions(experimental_fetch_to_device={self.experimental_fetch_to_device}, "
            f"experimental_replication_mode={self.experimental_replication_mode.name})"
        )


class InputContext:
    """What a ``dataset_fn`` given to ``distribute_datasets_from_function`` learns.

    >>> InputContext(num_replicas_in_sync=4).get_per_replica_batch_size(64)
    16
    """

    def __init__(
        self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1
    ) -> None:
        if not 0 <= input_pipeline_id < num_input_pipelines:
            raise InvalidArgumentError(
                f"input_pipeline_id {input_pipeline_id} is not in [0, {num_input_pipelines})"
            )
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """How many input pipelines there are: one per worker."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index among them: the worker's index."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take one global batch between them."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` divided by the replicas in sync (it must divide evenly)."""
        if global_batch_size % self._num_replicas_in_sync != 0:
            raise InvalidArgumentError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {self._num_replicas_in_sync!r}"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


class DistributedDataset:
    """A dataset distributed over the replicas: iterable, with ``element_spec``; no further
    transformations (as TF). Built where it is first iterated (on each worker when
    passed to ``create_per_worker_dataset``)."""

    def __init__(
        self,
        dataset: Any = None,
        dataset_fn: Callable[[InputContext], Any] | None = None,
        context: InputContext | None = None,
        options: InputOptions | None = None,
    ) -> None:
        if (dataset is None) == (dataset_fn is None):
            raise InvalidArgumentError("DistributedDataset needs a dataset or a dataset_fn")
        if dataset is not None and not hasattr(dataset, "__iter__"):
            raise InvalidArgumentError(
                f"experimental_distribute_dataset needs a dataset (an iterable), got {type(dataset).__name__}"
            )
        if dataset_fn is not None and not callable(dataset_fn):
            raise InvalidArgumentError(
                "distribute_datasets_from_function needs a function taking an InputContext"
            )
        if options is not None and not isinstance(options, InputOptions):
            raise InvalidArgumentError(f"options must be an InputOptions, got {type(options).__name__}")
        self._dataset = dataset
        self._dataset_fn = dataset_fn
        self._context = context or InputContext()
        self.options = options

    def _built(self) -> Any:
        if self._dataset is None:
            assert self._dataset_fn is not None
            dataset = self._dataset_fn(self._context)
            if not hasattr(dataset, "__iter__"):
                raise InvalidArgumentError(
                    f"dataset_fn returned {type(dataset).__name__}, not a dataset (an iterable)"
                )
            self._dataset = dataset
        return self._dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self._built())

    @property
    def element_spec(self) -> Any:
        """The type specification of the elements (the dataset's own, one replica)."""
        spec = getattr(self._built(), "element_spec", None)
        if spec is None:
            raise InvalidArgumentError(
                f"element_spec needs a pstrain.data.Dataset; this one is a {type(self._built()).__name__}"
            )
        return spec

    def __getstate__(self) -> dict[str, Any]:
        # Sent to workers: a dataset made by a function is built there, not here.
        state = dict(self.__dict__)
        if self._dataset_fn is not None:
            state["_dataset"] = None
        return state

    def __repr__(self) -> str:
        return f"<DistributedDataset of {self._dataset_fn or type(self._dataset).__name__}>"


expose(globals(), "pstrain", ["DistributedDataset", "InputContext", "InputOptions", "InputReplicationMode"])
