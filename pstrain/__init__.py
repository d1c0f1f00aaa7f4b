"""pstrain: an asyncio-native parameter-server training runtime.

The public API, re-exported here by name and loaded on first use, so that
``import pstrain`` stays cheap and has no side effects.

>>> import pstrain
>>> pstrain.ReduceOp.SUM.value
'SUM'
"""

from __future__ import annotations

import importlib
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
    "PerReplica": "values",
    "PerWorkerValues": "values",
    "ReduceOp": "strategy",
    "RemoteValue": "remote_value",
    "ShardedVariable": "sharding",
    "SidecarEvaluator": "evaluator",
    "ReplicaContext": "strategy",
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
    "get_replica_context": "strategy",
    "read_variables": "variables",
    "update_variables": "variables",
    "run": "bridge",
}
_SUBMODULES = ("checkpoint", "data", "errors", "evaluator", "initializers", "metrics", "optimizers",
               "partitioners", "rpc")

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


if TYPE_CHECKING:  # pragma: no cover
    from . import checkpoint, data, errors, evaluator, initializers, metrics, optimizers, partitioners, rpc
    from .bridge import run
    from .checkpoint import Checkpoint, CheckpointManager
    from .cluster import (
        ClusterResolver,
        ClusterSpec,
        SimpleClusterResolver,
        SlurmClusterResolver,
        TFConfigClusterResolver,
    )
    from .context import get_current_worker_index
    from .coordinator import ClusterCoordinator
    from .evaluator import SidecarEvaluator
    from .launch import LocalCluster
    from .module import Module
    from .remote_value import RemoteValue
    from .server import Server
    from .sharding import ShardedVariable, embedding_lookup
    from .strategy import ParameterServerStrategy, ReduceOp, ReplicaContext, get_replica_context
    from .values import DistributedValues, PerReplica, PerWorkerValues, ValueContext
    from .variables import (
        IndexedSlices,
        Variable,
        VariableAggregation,
        VariableSynchronization,
        read_variables,
        update_variables,
    )
