"""``strategy.extended``: placement details and lower-level updates
(``extended.update``, ``colocate_vars_with``, ``reduce_to``) of a
:class:`~pstrain.ParameterServerStrategy`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from .._base.cluster import task_name
from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._formats.messages.operations import CallVariables
from .._variables.arrays import current_creator
from .._variables.batched import ensure_created
from .._variables.placement import Placement
from .._variables.sharding import ShardedVariable
from .._variables.variables import Variable
from .distribution import ReduceOp

__all__ = ["StrategyExtended"]


class _Strategy(Protocol):
    """What ``extended`` uses of its strategy (``strategy.py`` imports this module)."""

    @property
    def num_ps(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def placement(self) -> Placement: ...

    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any: ...

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Any = None) -> Any: ...


class StrategyExtended:
    """``strategy.extended``: placement details and lower-level updates."""

    def __init__(self, strategy: _Strategy) -> None:
        self._strategy = strategy

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The parameter servers' device names, one per ps."""
        return tuple(task_name("ps", i) + "/device:CPU:0" for i in range(self._strategy.num_ps))

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The workers' device names, one per worker."""
        return tuple(task_name("worker", i) + "/device:CPU:0" for i in range(self._strategy.num_workers))

    @property
    def experimental_require_static_shapes(self) -> bool:
        """False: variables and values may have any shape (as TF's parameter-server strategy)."""
        return False

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside go to the ps of ``colocate_with_variable`` (inside the scope)."""
        if current_creator() is not self._strategy.placement:
            raise InvalidArgumentError(
                "colocate_vars_with must be used inside strategy.scope(): "
                "outside it, variables are local and go nowhere"
            )
        ps = getattr(colocate_with_variable, "ps_index", None)
        if ps is None:
            raise InvalidArgumentError("colocate_vars_with needs a variable placed on a ps")
        with self._strategy.placement.colocated(ps):
            yield

    async def update(
        self,
        var: Any,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run ``fn(var_array, *args, **kwargs)`` on the ps holding ``var``; return its result.

        ``var`` arrives as a writable numpy array; variables in ``args``/``kwargs`` that live
        on the same ps arrive as arrays too. Only ``fn``'s result travels back. For a sharded
        variable ``fn`` runs on every part (concurrently) and the results come back as a list.
        ``group`` (TF's name) has no effect: there is one replica per worker.
        """
        if isinstance(var, ShardedVariable):
            return list(await asyncio.gather(*(self.update(p, fn, args, kwargs) for p in var.variables)))
        if not isinstance(var, Variable):
            raise InvalidArgumentError(f"extended.update needs a variable, got {type(var).__name__}")
        if var.ps_index is None:
            return fn(var.local_array(), *_local_arrays(args), **_local_arrays(kwargs or {}))
        await ensure_created([var])

        def ref(obj: Any) -> Any:
            if isinstance(obj, Variable):
                if obj.ps_index != var.ps_index:
                    raise InvalidArgumentError(
                        f"variable {obj.name!r} is on {obj.device}, not colocated with {var.name!r}"
                    )
                return {"__pstrain_var__": obj.key}
            if type(obj) is tuple:
                return tuple(ref(x) for x in obj)
            if type(obj) is list:
                return [ref(x) for x in obj]
            return obj

        reply = await var.channel().request(
            CallVariables(
                fn=fn,
                vars=[var.key],
                args=ref(tuple(args)),
                kwargs={k: ref(v) for k, v in (kwargs or {}).items()},
            )
        )
        return reply.result

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``fn`` once per replica (once: one replica per worker), as ``strategy.run``."""
        return self._strategy.run(fn, args, kwargs)

    def reduce_to(
        self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None
    ) -> Any:
        """Combine a per-replica ``value`` for ``destinations`` (one replica per worker here).

        ``options`` (TF's communication options) has no effect.
        """
        return self._strategy.reduce(reduce_op, value, axis=None)

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: Any = None,
        experimental_hints: Any = None,
    ) -> list[Any]:
        """:meth:`reduce_to` over ``(value, destinations)`` pairs (TF's hints have no effect)."""
        return [self.reduce_to(reduce_op, v, d) for v, d in value_destination_pairs]


def _local_arrays(obj: Any) -> Any:
    if isinstance(obj, Variable) and obj.ps_index is None:
        return obj.local_array()
    if isinstance(obj, dict):
        return {k: _local_arrays(v) for k, v in obj.items()}
    if type(obj) in (tuple, list):
        return type(obj)(_local_arrays(x) for x in obj)
    return obj


expose(globals(), "pstrain", ["StrategyExtended"])
