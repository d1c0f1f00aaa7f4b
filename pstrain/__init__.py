"""pstrain: an asyncio-native parameter-server training runtime.

The public API, re-exported here by name and loaded on first use, so that
``import pstrain`` stays cheap and has no side effects (but one: with PSTRAIN_DASHBOARD set,
by ``pstrain launch --dashboard``, it loads the dashboard, whose coordinators then serve it).

>>> import pstrain
>>> pstrain.ReduceOp.SUM.value
'SUM'
"""

from __future__ import annotations

import importlib
import os as _os
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS: dict[str, str] = {
    "Checkpoint": "_checkpoint.checkpoint",
    "CheckpointManager": "_checkpoint.manager",
    "ClusterCoordinator": "_coordinator.coordinator",
    "ClusterResolver": "_base.resolvers",
    "ClusterSpec": "_base.cluster",
    "DistributedValues": "_distribute.values",
    "IndexedSlices": "_variables.arrays",
    "LocalCluster": "launch",
    "Module": "_training.module",
    "ParameterServerStrategy": "_distribute.strategy",
    "StrategyExtended": "_distribute.extended",
    "PerReplica": "_distribute.values",
    "PerWorkerValues": "_distribute.values",
    "ReduceOp": "_distribute.distribution",
    "RemoteValue": "_coordinator.remote_value",
    "ShardedVariable": "_variables.sharding",
    "DynamicEmbedding": "_variables.dynamic",
    "SidecarEvaluator": "_checkpoint.evaluator",
    "ReplicaContext": "_distribute.distribution",
    "CheckpointLoadStatus": "_checkpoint.checkpoint",
    "DistributedDataset": "_distribute.input_distribution",
    "InputContext": "_distribute.input_distribution",
    "InputOptions": "_distribute.input_distribution",
    "InputReplicationMode": "_distribute.input_distribution",
    "TensorSpec": "_training.specs",
    "Server": "server",
    "SimpleClusterResolver": "_base.resolvers",
    "SlurmClusterResolver": "_base.resolvers",
    "TFConfigClusterResolver": "_base.resolvers",
    "ValueContext": "_distribute.values",
    "Variable": "_variables.variables",
    "VariableAggregation": "_variables.arrays",
    "VariableSynchronization": "_variables.arrays",
    "get_current_worker_index": "_base.context",
    "embedding_lookup": "_embeddings.ragged_rows",
    "embedding_lookup_sparse": "_embeddings.pooling",
    "safe_embedding_lookup_sparse": "_embeddings.pooling",
    "EmbeddingCollection": "_embeddings.collection",
    "PooledEmbeddings": "_embeddings.collection",
    "GatheredRows": "_embeddings.collection",
    "TableConfig": "_embeddings.config",
    "JaggedTensor": "_embeddings.jagged",
    "RequestCounts": "_transport.traffic",
    "count_requests": "_transport.traffic",
    "KeyedJaggedTensor": "_embeddings.jagged",
    "SparseTensor": "_embeddings.jagged",
    "get_replica_context": "_distribute.distribution",
    "get_strategy": "_distribute.distribution",
    "has_strategy": "_distribute.distribution",
    "in_cross_replica_context": "_distribute.distribution",
    "read_variables": "_variables.batched",
    "update_variables": "_variables.batched",
    "run": "_transport.bridge",
}
_SUBMODULES = (
    "checkpoint",
    "dashboard",
    "data",
    "errors",
    "evaluator",
    "initializers",
    "math",
    "metrics",
    "nn",
    "optimizers",
    "partitioners",
    "rpc",
    "schedules",
    "strings",
    "summary",
    "testing",
)

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        # not cached in globals(): doctest would then find the classes here too
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'pstrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - what type checkers see; the table above is what runs
    from . import (
        checkpoint as checkpoint,
        dashboard as dashboard,
        data as data,
        errors as errors,
        evaluator as evaluator,
        initializers as initializers,
        math as math,
        metrics as metrics,
        nn as nn,
        optimizers as optimizers,
        partitioners as partitioners,
        rpc as rpc,
        schedules as schedules,
        strings as strings,
        summary as summary,
        testing as testing,
    )
    from ._base.cluster import (
        ClusterSpec as ClusterSpec,
    )
    from ._base.context import (
        get_current_worker_index as get_current_worker_index,
    )
    from ._base.resolvers import (
        ClusterResolver as ClusterResolver,
        SimpleClusterResolver as SimpleClusterResolver,
        SlurmClusterResolver as SlurmClusterResolver,
        TFConfigClusterResolver as TFConfigClusterResolver,
    )
    from ._checkpoint.checkpoint import (
        Checkpoint as Checkpoint,
        CheckpointLoadStatus as CheckpointLoadStatus,
    )
    from ._checkpoint.evaluator import (
        SidecarEvaluator as SidecarEvaluator,
    )
    from ._checkpoint.manager import (
        CheckpointManager as CheckpointManager,
    )
    from ._coordinator.coordinator import (
        ClusterCoordinator as ClusterCoordinator,
    )
    from ._coordinator.remote_value import (
        RemoteValue as RemoteValue,
    )
    from ._distribute.distribution import (
        ReduceOp as ReduceOp,
        ReplicaContext as ReplicaContext,
        get_replica_context as get_replica_context,
        get_strategy as get_strategy,
        has_strategy as has_strategy,
        in_cross_replica_context as in_cross_replica_context,
    )
    from ._distribute.extended import StrategyExtended as StrategyExtended
    from ._distribute.input_distribution import (
        DistributedDataset as DistributedDataset,
        InputContext as InputContext,
        InputOptions as InputOptions,
        InputReplicationMode as InputReplicationMode,
    )
    from ._distribute.strategy import ParameterServerStrategy as ParameterServerStrategy
    from ._distribute.values import (
        DistributedValues as DistributedValues,
        PerReplica as PerReplica,
        PerWorkerValues as PerWorkerValues,
        ValueContext as ValueContext,
    )
    from ._embeddings.collection import (
        EmbeddingCollection as EmbeddingCollection,
        GatheredRows as GatheredRows,
        PooledEmbeddings as PooledEmbeddings,
    )
    from ._embeddings.config import (
        TableConfig as TableConfig,
    )
    from ._embeddings.jagged import (
        JaggedTensor as JaggedTensor,
        KeyedJaggedTensor as KeyedJaggedTensor,
        SparseTensor as SparseTensor,
    )
    from ._embeddings.pooling import (
        embedding_lookup_sparse as embedding_lookup_sparse,
        safe_embedding_lookup_sparse as safe_embedding_lookup_sparse,
    )
    from ._embeddings.ragged_rows import embedding_lookup as embedding_lookup
    from ._training.module import (
        Module as Module,
    )
    from ._training.specs import (
        TensorSpec as TensorSpec,
    )
    from ._transport.bridge import (
        run as run,
    )
    from ._transport.traffic import (
        RequestCounts as RequestCounts,
        count_requests as count_requests,
    )
    from ._variables.arrays import (
        IndexedSlices as IndexedSlices,
        VariableAggregation as VariableAggregation,
        VariableSynchronization as VariableSynchronization,
    )
    from ._variables.batched import (
        read_variables as read_variables,
        update_variables as update_variables,
    )
    from ._variables.dynamic import DynamicEmbedding as DynamicEmbedding
    from ._variables.sharding import ShardedVariable as ShardedVariable
    from ._variables.variables import Variable as Variable
    from .launch import (
        LocalCluster as LocalCluster,
    )
    from .server import Server as Server


if _os.environ.get("PSTRAIN_DASHBOARD"):  # pstrain launch --dashboard: coordinators serve it
    from . import dashboard as _dashboard  # noqa: F401 - registers its start hook
