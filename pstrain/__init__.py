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

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Checkpoint": "checkpoint",
    "CheckpointManager": "checkpoint",
    "ClusterCoordinator": "coordinator",
    "ClusterResolver": "cluster",
    "ClusterSpec": "cluster",
    "DistributedValues": "values",
    "IndexedSlices": "variables",
    "LocalCluster": "launch",
    "Module": "module",
    "ParameterServerStrategy": "strategy",
    "StrategyExtended": "strategy",
    "PerReplica": "values",
    "PerWorkerValues": "values",
    "ReduceOp": "distribution",
    "RemoteValue": "remote_value",
    "ShardedVariable": "sharding",
    "DynamicEmbedding": "dynamic",
    "SidecarEvaluator": "evaluator",
    "ReplicaContext": "distribution",
    "CheckpointLoadStatus": "checkpoint",
    "DistributedDataset": "input_distribution",
    "InputContext": "input_distribution",
    "InputOptions": "input_distribution",
    "InputReplicationMode": "input_distribution",
    "TensorSpec": "data",
    "Server": "server",
    "SimpleClusterResolver": "cluster",
    "SlurmClusterResolver": "cluster",
    "TFConfigClusterResolver": "cluster",
    "ValueContext": "values",
    "Variable": "variables",
    "VariableAggregation": "variables",
    "VariableSynchronization": "variables",
    "get_current_worker_index": "context",
    "embedding_lookup": "sharding",
    "get_replica_context": "distribution",
    "get_strategy": "distribution",
    "has_strategy": "distribution",
    "in_cross_replica_context": "distribution",
    "read_variables": "variables",
    "update_variables": "variables",
    "run": "bridge",
}
_SUBMODULES = ("checkpoint", "dashboard", "data", "errors", "evaluator", "initializers", "metrics",
               "optimizers", "partitioners", "rpc", "summary", "testing")

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value
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
        metrics as metrics,
        optimizers as optimizers,
        partitioners as partitioners,
        rpc as rpc,
        summary as summary,
        testing as testing,
    )
    from .bridge import (
        run as run,
    )
    from .checkpoint import (
        Checkpoint as Checkpoint,
        CheckpointLoadStatus as CheckpointLoadStatus,
        CheckpointManager as CheckpointManager,
    )
    from .cluster import (
        ClusterResolver as ClusterResolver,
        ClusterSpec as ClusterSpec,
        SimpleClusterResolver as SimpleClusterResolver,
        SlurmClusterResolver as SlurmClusterResolver,
        TFConfigClusterResolver as TFConfigClusterResolver,
    )
    from .context import (
        get_current_worker_index as get_current_worker_index,
    )
    from .coordinator import (
        ClusterCoordinator as ClusterCoordinator,
    )
    from .data import (
        TensorSpec as TensorSpec,
    )
    from .distribution import (
        ReduceOp as ReduceOp,
        ReplicaContext as ReplicaContext,
        get_replica_context as get_replica_context,
        get_strategy as get_strategy,
        has_strategy as has_strategy,
        in_cross_replica_context as in_cross_replica_context,
    )
    from .dynamic import DynamicEmbedding as DynamicEmbedding
    from .evaluator import (
        SidecarEvaluator as SidecarEvaluator,
    )
    from .input_distribution import (
        DistributedDataset as DistributedDataset,
        InputContext as InputContext,
        InputOptions as InputOptions,
        InputReplicationMode as InputReplicationMode,
    )
    from .launch import (
        LocalCluster as LocalCluster,
    )
    from .module import (
        Module as Module,
    )
    from .remote_value import (
        RemoteValue as RemoteValue,
    )
    from .server import (
        Server as Server,
    )
    from .sharding import (
        ShardedVariable as ShardedVariable,
        embedding_lookup as embedding_lookup,
    )
    from .strategy import (
        ParameterServerStrategy as ParameterServerStrategy,
        StrategyExtended as StrategyExtended,
    )
    from .values import (
        DistributedValues as DistributedValues,
        PerReplica as PerReplica,
        PerWorkerValues as PerWorkerValues,
        ValueContext as ValueContext,
    )
    from .variables import (
        IndexedSlices as IndexedSlices,
        Variable as Variable,
        VariableAggregation as VariableAggregation,
        VariableSynchronization as VariableSynchronization,
        read_variables as read_variables,
        update_variables as update_variables,
    )


if _os.environ.get("PSTRAIN_DASHBOARD"):  # pstrain launch --dashboard: coordinators serve it
    from . import dashboard as _dashboard  # noqa: F401 - registers its start hook
