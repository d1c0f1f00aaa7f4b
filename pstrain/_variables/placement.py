"""Placement: where a strategy's variables go, under which names, and when they exist.

One :class:`Placement` per strategy owns everything about creating variables:

* **names**: ``name``, then ``name_1``, ``name_2`` ... (TF's uniquification);
  a second live strategy on the same cluster in one process qualifies the ps
  keys of its variables (``strategy_1/...``) while their ``name`` stays as TF
  shows it, so it creates variables of its own (a notebook cell run twice);
* **ownership**: creations carry this placement's ``owner`` id; the ps lets a
  new owner take over variables of the same key (a restarted coordinator
  re-creating its model replaces the dead one's variables and their slots)
  and refuses a true duplicate;
* **round-robin**: one counter over the ps (with 3 ps, successive variables
  land on ps 0, 1, 2, 0), shared by whole variables and the parts of
  sharded ones; :meth:`Placement.colocated` pins creations to one ps;
* **partitioning**: with a ``variable_partitioner``, a variable becomes a
  :class:`~pstrain._variables.sharding.ShardedVariable` of parts placed round-robin;
* **batched creation**: a handle returns at once, its creation is queued and
  :meth:`Placement.ensure_created` sends every queued creation, one request
  per ps, concurrently. Each handle carries a *ticket*; it exists once
  ``created_upto`` reaches it, so a check costs one comparison;
* **queued restores**: :meth:`queue_restore` puts a checkpoint's rows into a
  variable (or an optimizer slot) with the next creation batch, after the
  creations; the handles it names wait for it like for their creation. The
  checkpoint module uses it for values restored after ``restore()`` returned
  (deferred restoration); placement does not know the file format.

It is the *creator* (``variables.VariableCreator``) a strategy scope installs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import secrets
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._base.checks import shape as checked_shape, variable_name
from .._base.context import current_channels
from .._base.errors import InvalidArgumentError, UnavailableError
from .._base.tasks import TaskOwner
from .._formats.messages.checkpoint_operations import CommitRestore, RestoreCheckpoint, RestoreSpec
from .._formats.messages.operations import CREATE_CHUNK_BYTES, CreateVariables, Fence, VariableSpec
from .._formats.numerics.casting import NUMERIC_KINDS
from .._formats.numerics.initializers import Initializer
from .._transport.channels import Channel, ChannelPool
from .arrays import VariableBase, creator_scope, initial_value_array
from .sharding import ShardedVariable, plan_parts
from .variables import Variable

logger = logging.getLogger(__name__)

__all__ = ["Placement"]

STARTUP_TIMEOUT_S = 60.0  # how long variable creation waits for a ps that has never answered


class Placement:
    """Names, places and creates the variables of one strategy.

    >>> p = Placement(num_ps=2, channels=None)
    >>> p.unique_name("w"), p.unique_name("w"), [p.next_ps() for _ in range(3)]
    ('w', 'w_1', [0, 1, 0])
    """

    def __init__(
        self,
        num_ps: int,
        channels: ChannelPool | None,
        partitioner: Callable[..., Sequence[int]] | None = None,
        *,
        namespace: str = "",
    ) -> None:
        self.num_ps = num_ps
        self.namespace = namespace  # prefix of the ps keys ("" for the first strategy)
        self.owner = uuid.uuid4().hex
        self.startup_timeout_s = STARTUP_TIMEOUT_S
        self.channels = channels  # None on a worker: the closure's channels
        if channels is not None:  # this strategy's updates say which coordinator sent them
            channels.session.owner = self.owner
        self.partitioner = partitioner
        self.issued = 0  # creations accepted (the last ticket given)
        self.created_upto = 0  # creations sent
        self._lock = threading.Lock()
        self._next_ps = 0
        #: The ps new variables go to in turn (an elastic ps change updates it).
        self.active = list(range(num_ps))
        #: key -> (the ps it was created on, its bytes): what the coordinator may move.
        self.placed: dict[str, tuple[int, int]] = {}
        #: key -> the dynamic table (its slices are what the coordinator may move).
        self.tables: dict[str, Any] = {}
        #: The optimizers whose step counter is mirrored on a second ps (a replacement of a
        #: ps that held one of the two gives it the other's count).
        self.counters: weakref.WeakSet[Any] = weakref.WeakSet()
        #: The ps the step counters of optimizers that need the step (Adam's, a schedule's)
        #: are made on, the first one's: so a step of several such optimizers counts them
        #: all in one request (``apply_together``).
        self.step_home: int | None = None
        self._names: dict[str, int] = {}
        self._colocate: contextvars.ContextVar[int | None] = contextvars.ContextVar(
            "pstrain_colocate", default=None
        )
        self._queued: dict[int, list[dict[str, Any]]] = {}
        self._restores: dict[int, list[dict[str, Any]]] = {}
        self._sending: asyncio.Task[None] | None = None
        self._tasks = TaskOwner("variable creation")

    # -- names and places --------------------------------------------------------------------
    def unique_name(self, name: str | None) -> str:
        """``name`` the first time, then ``name_1``, ``name_2`` ..."""
        base = (name or "Variable").rstrip("/") or "Variable"
        with self._lock:
            n = self._names.get(base, 0)
            self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def next_ps(self) -> int:
        """The ps of the next variable: the colocated one, else the next in round-robin."""
        colocated = self._colocate.get()
        if colocated is not None:
            return colocated
        with self._lock:
            ps = self.active[self._next_ps % len(self.active)]
            self._next_ps += 1
        return ps

    @property
    def colocating(self) -> int | None:
        """The ps a :meth:`colocated` block around the caller puts variables on, or None."""
        return self._colocate.get()

    @contextlib.contextmanager
    def colocated(self, ps: int) -> Iterator[None]:
        """Variables created inside go to ps ``ps`` (and are never partitioned)."""
        if not 0 <= ps < self.num_ps:
            raise InvalidArgumentError(f"no ps {ps}: the cluster has {self.num_ps}")
        token = self._colocate.set(ps)
        try:
            yield
        finally:
            self._colocate.reset(token)

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """``Variable(...)`` inside is created by this placement."""
        return creator_scope(self)

    def queue_restore(self, ps: int, entry: dict[str, Any], waiting: Sequence[Variable]) -> None:
        """Send ``entry`` (a ``ckpt/restore`` variable: name, dtype, shape, sources) to ps
        ``ps`` with the next creations, after them; ``waiting`` handles wait for it."""
        with self._lock:
            self.issued += 1
            ticket = self.issued
            self._restores.setdefault(ps, []).append(entry)
        for handle in waiting:
            handle.wait_for(ticket)

    # -- creation ---------------------------------------------------------------------------------
    def create_variable(
        self,
        initial_value: Any = None,
        name: str | None = None,
        dtype: Any = None,
        shape: Sequence[int] | None = None,
        trainable: bool = True,
        aggregation: Any = "NONE",
        synchronization: Any = "AUTO",
    ) -> Variable | ShardedVariable:
        """What ``pstrain.Variable(...)`` does inside a scope: a handle, created lazily."""
        if initial_value is None:
            raise InvalidArgumentError("Variable needs an initial_value")
        variable_name(name)
        if isinstance(initial_value, Initializer):
            if shape is None:
                raise InvalidArgumentError(f"{initial_value!r} needs shape= to build a variable")
            var_dtype = _placed_dtype(np.dtype(dtype) if dtype is not None else np.float32, name)
            var_shape = checked_shape(shape)
            entry: dict[str, Any] = {"init": initial_value.spec()}
            full_name = self.unique_name(name)  # once nothing can be refused: names count
        elif (
            callable(initial_value)
            and not isinstance(initial_value, VariableBase)
            and shape is not None
            and dtype is not None
            and self.partitioner is not None
            and tuple(shape)
            and self._colocate.get() is None
        ):
            # TF: a callable of known shape and dtype is asked for each shard by itself
            var_shape, var_dtype = checked_shape(shape), _placed_dtype(dtype, name)
            full_name = self.unique_name(name)
            parts = plan_parts(self.partitioner, full_name, var_shape, var_dtype)
            if parts is not None:
                values = _per_shard(initial_value, var_shape, var_dtype, parts)
                return self._sharded(
                    full_name, parts, var_shape, var_dtype, values, trainable, aggregation, synchronization
                )
            entry = {"value": initial_value_array(initial_value, dtype, shape)}
        else:
            value = initial_value_array(initial_value, dtype, shape)
            var_dtype, var_shape = _placed_dtype(value.dtype, name), value.shape
            entry = {"value": value}
            full_name = self.unique_name(name)
        parts = None
        if self.partitioner is not None and var_shape and self._colocate.get() is None:
            parts = plan_parts(self.partitioner, full_name, var_shape, var_dtype)
        if parts is None:
            return self._handle(
                full_name, entry, var_shape, var_dtype, trainable, aggregation, synchronization
            )
        part_entries: list[dict[str, Any]] = []
        for offset, rows in parts:
            if "init" in entry:
                part_entries.append(
                    {
                        "init": entry["init"],
                        "offset": [offset] + [0] * (len(var_shape) - 1),
                        "full_shape": list(var_shape),
                    }
                )
            else:
                part_entries.append({"value": entry["value"][offset : offset + rows]})
        return self._sharded(
            full_name, parts, var_shape, var_dtype, part_entries, trainable, aggregation, synchronization
        )

    def create_row_sharded(
        self,
        initializer: Initializer,
        name: str,
        shape: Sequence[int],
        dtype: Any,
        ps: Sequence[int],
        trainable: bool = True,
    ) -> Variable | ShardedVariable:
        """A variable of ``shape`` split by rows into ``len(ps)`` parts (TF's "div" layout),
        part ``i`` on ps ``ps[i]``, each initialised where it lives as the whole would be
        (what a planner that chose the ps does instead of the strategy's partitioner); one
        ps: a whole variable there."""
        var_shape, var_dtype = checked_shape(shape), _placed_dtype(np.dtype(dtype), name)
        if len(var_shape) < 1 or not ps or len(ps) > var_shape[0]:
            raise InvalidArgumentError(f"{name!r}: cannot split {var_shape} into {len(ps)} parts")
        for k in ps:
            if not 0 <= k < self.num_ps:
                raise InvalidArgumentError(f"no ps {k}: the cluster has {self.num_ps}")
        full_name = self.unique_name(name)
        parts = plan_parts(lambda s, d: [len(ps)] + [1] * (len(s) - 1), full_name, var_shape, var_dtype)
        if parts is None:  # one part: the whole variable on ps[0]
            return self._handle(
                full_name,
                {"init": initializer.spec()},
                var_shape,
                var_dtype,
                trainable,
                "NONE",
                "AUTO",
                ps[0],
            )
        entries = [
            {
                "init": initializer.spec(),
                "offset": [offset] + [0] * (len(var_shape) - 1),
                "full_shape": list(var_shape),
            }
            for offset, _ in parts
        ]
        return self._sharded(full_name, parts, var_shape, var_dtype, entries, trainable, "NONE", "AUTO", ps)

    def _sharded(
        self,
        name: str,
        parts: Sequence[tuple[int, int]],
        shape: tuple[int, ...],
        dtype: np.dtype,
        entries: list[dict[str, Any]],
        trainable: bool,
        aggregation: Any,
        synchronization: Any,
        ps: Sequence[int] | None = None,
    ) -> ShardedVariable:
        handles = [
            self._handle(
                f"{name}/part_{i}",
                entry,
                (rows,) + shape[1:],
                dtype,
                trainable,
                aggregation,
                synchronization,
                None if ps is None else ps[i],
            )
            for i, ((_, rows), entry) in enumerate(zip(parts, entries))
        ]
        return ShardedVariable(handles, name=name)

    def _handle(
        self,
        name: str,
        entry: dict[str, Any],
        shape: tuple[int, ...],
        dtype: np.dtype,
        trainable: bool,
        aggregation: Any,
        synchronization: Any,
        ps: int | None = None,
    ) -> Variable:
        ps = self.next_ps() if ps is None else ps
        key = self.namespace + name
        entry.update(name=key, dtype=dtype.str, shape=shape, trainable=trainable)
        with self._lock:
            self.placed[key] = (ps, math.prod(shape) * dtype.itemsize)
            self.issued += 1
            ticket = self.issued
            self._queued.setdefault(ps, []).append(entry)
        return Variable.handle(
            key,
            shape,
            dtype,
            ps,
            self.channels,
            trainable,
            aggregation,
            synchronization,
            creator=self,
            ticket=ticket,
            display_name=name,
        )

    def creations_to_send(self) -> Awaitable[None] | None:
        """``ensure_created()`` if creations are queued, else None (a check that costs nothing)."""
        return self.ensure_created() if self.created_upto < self.issued else None

    async def ensure_created(self) -> None:
        """Send every queued creation (one request per ps, concurrently) and wait for it.

        Concurrent callers share one send; each returns once everything queued
        before its call exists, or raises the error of the send that covered it.
        """
        while self.created_upto < self.issued:
            sending = self._sending
            if sending is None or sending.done():
                with self._lock:
                    queued, self._queued = self._queued, {}
                    restores, self._restores = self._restores, {}
                    upto = self.issued
                sending = self._sending = self._tasks.spawn(self._send(queued, restores, upto), observed=True)
            await asyncio.shield(sending)

    async def _send(
        self, queued: dict[int, list[dict[str, Any]]], restores: dict[int, list[dict[str, Any]]], upto: int
    ) -> None:
        try:
            results = await asyncio.gather(
                *(self._create_on(ps, entries) for ps, entries in queued.items()), return_exceptions=True
            )
            if restores and not any(isinstance(r, BaseException) for r in results):
                results = await asyncio.gather(
                    *(self._restore(ps, entries) for ps, entries in restores.items()), return_exceptions=True
                )
        finally:
            self.created_upto = max(self.created_upto, upto)  # sent, whatever the answer
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def _create_on(self, ps: int, entries: list[dict[str, Any]]) -> Any:
        """``vars/create`` on ``ps``. A ps never reached yet may still be starting (SLURM and
        Kubernetes start every task at once): it is retried, with back-off, for up to
        ``startup_timeout_s``; once reached, an unreachable ps is an error at once."""
        channel = self._channel(ps)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        pause = 0.05
        while True:
            try:
                # In requests of at most CREATE_CHUNK_BYTES (a larger variable alone): a ps
                # refuses a request that would make more than one variable's limit at once.
                for chunk in _chunks(entries):
                    await channel.request(
                        CreateVariables(vars=[VariableSpec(**e) for e in chunk], owner=self.owner)
                    )
                return None
            except UnavailableError as exc:
                if channel.ever_connected or channel.closed:
                    raise
                if loop.time() + pause > deadline:
                    raise UnavailableError(
                        f"{channel.task} at {channel.address} did not start within "
                        f"{self.startup_timeout_s:g} s: {exc}. If it left the job before this "
                        "coordinator started (drained, or lost and replaced), start a ps there "
                        "again: an empty one serves, and a restore puts its share back; or go on "
                        f"without it: await coordinator.remove_ps({ps}) before making the "
                        "variables, and the restore puts its share on the others",
                        task=channel.task,
                    ) from exc
                if pause == 0.05:  # said at once, where the user sees it: what, where, how long
                    logger.warning(
                        "waiting up to %g s for %s at %s to start (if it left the job, "
                        "await coordinator.remove_ps(%d) before making the variables "
                        "goes on without it): %s",
                        self.startup_timeout_s,
                        channel.task,
                        channel.address,
                        ps,
                        exc,
                    )
            await asyncio.sleep(pause)  # back-off between attempts to reach a starting ps
            pause = min(pause * 2, 1.0)

    async def _restore(self, ps: int, entries: list[dict[str, Any]]) -> None:
        channel = self._channel(ps)
        await fences_first(channel)
        stage = secrets.token_hex(8)
        await channel.request(RestoreCheckpoint(vars=[RestoreSpec(**e) for e in entries], stage=stage))
        await channel.request(CommitRestore(stage=stage))

    def _channel(self, ps: int) -> Any:
        pool = self.channels if self.channels is not None else current_channels()
        return pool.channel("ps", ps)


async def fences_first(channel: Channel) -> None:
    """Send the ps of ``channel`` every fence its coordinator set, before a restore puts
    values there: a ps that restarted lost them, and a worker declared lost but still
    running an old dispatch would otherwise apply it on top of the restored values."""
    fences = list(channel.session.fences.items())
    await asyncio.gather(
        *(channel.request(Fence(worker=w, epoch=e, owner=channel.session.owner)) for w, e in fences)
    )


#: Above this many elements, building a whole value to slice it is worth a warning (TF's).
_LARGE = 10**9


def _per_shard(
    init: Callable[..., Any], shape: tuple[int, ...], dtype: np.dtype, parts: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """Each shard's value from ``init(partition_shape=, partition_offset=)`` (TF's rule);
    a callable that refuses those arguments, or answers with another shape, is called
    once for the whole value, which is then sliced."""
    values = []
    try:
        for offset, rows in parts:
            part_shape = (rows,) + shape[1:]
            value = np.asarray(
                init(partition_shape=part_shape, partition_offset=(offset,) + (0,) * (len(shape) - 1)), dtype
            )
            if value.shape != part_shape:
                raise ValueError(f"shard of shape {value.shape}, not {part_shape}")
            values.append({"value": value})
        return values
    except (TypeError, ValueError):
        if int(np.prod(shape)) > _LARGE:
            logger.warning(
                "the initial value of a %s variable is built whole, then sliced into "
                "%d shards: give a callable that accepts partition_shape and "
                "partition_offset",
                shape,
                len(parts),
            )
        full = initial_value_array(init, dtype, shape)
        return [{"value": full[offset : offset + rows]} for offset, rows in parts]


def _chunks(entries: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``entries`` in order, grouped so that each group is at most ``CREATE_CHUNK_BYTES``
    of variables, or one variable.

    >>> e = [{"shape": [1 << 20], "dtype": "<f4"}] * 3
    >>> [len(c) for c in _chunks(e)]
    [2, 1]
    """
    chunks: list[list[dict[str, Any]]] = []
    size = 0
    for entry in entries:
        n = math.prod(entry["shape"]) * np.dtype(entry["dtype"]).itemsize
        if not chunks or size + n > CREATE_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += n
    return chunks


def _placed_dtype(dtype: Any, name: str | None) -> np.dtype:
    """``dtype``, if a ps can hold a variable of it (numbers and bools; a local variable may
    hold strings, as in TF)."""
    dt = np.dtype(dtype)
    if dt.kind not in NUMERIC_KINDS or dt.hasobject:
        raise InvalidArgumentError(
            f"variable {name or 'Variable'!r}: a ps holds numbers and bools, "
            f"not {dt} (a variable outside strategy.scope() may)"
        )
    return dt
