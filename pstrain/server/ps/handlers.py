"""The parameter server: the handlers that read and update its variable store.

Every request arrives as its declared class (``operations.py``), already
checked for field names, types and sizes. Handlers then check what needs the
store (names, shapes, dtypes, row ids) for the *whole* request before the
first array changes, so every operation is all or nothing; the plain ones
run on the serving loop with no ``await`` inside, which makes each atomic.
Values are converted to a variable's dtype only when nothing is lost
(``casting.py``).

Limits: a variable is at most ``max_variable_bytes`` (its initializer runs
off the serving loop); a gathered reply (``vars/sparse_read``, which copies
rows) is at most ``max_gather_bytes``. The variables themselves, with their
pins and copy-on-write, are the :class:`~pstrain.server.ps.store.VariableStore`;
optimizer rules come from ``optimizer_rules.py``, checkpoint files from
``checkpoints/saves.py``. ``allow_pickle=False`` refuses ``vars/call`` (the only
operation that runs a caller's function) before anything is decoded.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import ssl
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._base.checks import byte_size, whole
from ..._base.cluster import task_name
from ..._base.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from ..._base.machine import memory_limit, resident_memory
from ..._formats.messages.checkpoint_operations import (
    AbortRestore,
    CommitRestore,
    RestoreCheckpoint,
)
from ..._formats.messages.operations import (
    CREATE_CHUNK_BYTES,
    SINGLE_UPDATES,
    ApplyGradients,
    CallVariables,
    CreateVariables,
    DeleteVariables,
    Fence,
    ListVariables,
    LookupTables,
    ReadVariables,
    SingleUpdate,
    SparseRead,
    Update,
    UpdateKind,
    UpdateVariables,
)
from ..._formats.messages.records import (
    AbortReply,
    CallReply,
    CommitReply,
    CreatedReply,
    DeletedReply,
    ListReply,
    Mutation,
    Operation,
    R,
    RestoreReply,
    StepReply,
    UpdatedReply,
    ValuesReply,
    VariableInfo,
)
from ..._formats.numerics import scatter as scatter_rule
from ..._kernels import KERNELS
from ..._kernels.batches import take_rows
from ..._serving.base import ServerBase, http_face_to_come
from ..._serving.core import HandlerFn, Pinned
from ..._transport.channels import Channel
from .before_images import BeforeImages
from .checkpoints import saves as ps_checkpoint
from .checkpoints.deltas import Deltas
from .checkpoints.feed import PATH as FEED_PATH, TableFeed
from .compute import apply_gradients, call_function
from .creation import itemsize, plan_create
from .fencing import Fencing
from .moves.handlers import Moves
from .store import Budget, VariableRecord, VariableStore, checked_rows, checked_value
from .tables.handlers import TableHandlers, table_scope
from .tables.table_slices import SliceGuards
from .tables.tier_directories import TierDirectory
from .tables.tiered_table import Tiering

_EMPTY = np.zeros(0)  # the array of a record built only to check a name

logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]

#: Default largest variable a ps creates (its initializer or value), in bytes.
DEFAULT_MAX_VARIABLE_BYTES = 512 << 20
#: Default largest reply that copies data (gathered rows), in bytes.
DEFAULT_MAX_GATHER_BYTES = 32 << 20
#: Default largest reply of whole variables (``vars/read``), in bytes.
DEFAULT_MAX_REPLY_BYTES = 1 << 30


def tier_directory(
    budget: int | str | None, table_dir: str | None, segment_rows: int = 1 << 20
) -> tuple[Tiering, TierDirectory] | None:
    """This process's tiering under ``table_dir`` (None without a budget and a directory;
    ``budget`` in bytes, or a size such as ``"512MiB"``), in a directory of its own, locked
    while the ps lives (:class:`TierDirectory`: those of ps that are gone removed first)."""
    if budget is None or table_dir is None:
        if (budget is None) != (table_dir is None):
            raise InvalidArgumentError(
                "a ps tiers its tables with both memory_budget and table_dir, or neither"
            )
        return None
    budget = byte_size(budget, "memory_budget")
    segment_rows = whole(segment_rows, "table_segment_rows", 1)
    if not isinstance(table_dir, (str, os.PathLike)):
        raise InvalidArgumentError(f"table_dir must be a directory's path, got {table_dir!r}")
    own = TierDirectory(os.fspath(table_dir))
    return Tiering(budget=budget, directory=own.path, segment_rows=segment_rows), own


def default_max_store_bytes(limit: tuple[int, str] | None) -> int:
    """Default bytes of variables, tables (and staged restores) a ps holds: 80 % of the
    memory this process may use (``limit``, :func:`memory_limit`: the machine's RAM, or its
    cgroup's limit if lower: a container's), less what the process holds already (its
    interpreter and libraries, 100 MB or more: in a small container, a large share of it)
    and what its HTTP face will hold once a connection sets it up."""
    if limit is None:
        return 1 << 40
    return max(1 << 20, int(limit[0] * 0.8) - resident_memory() - http_face_to_come())


def _warn_past_memory_limit(task: str, limit: tuple[int, str] | None, sizes: dict[str, int | None]) -> None:
    """A warning for each of ``sizes`` (by what it is) past ``limit``, the memory this
    process may use: the kernel kills the ps there, before it refuses anything."""
    for what, size in sizes.items():
        if limit is not None and size is not None and size > limit[0]:
            logger.warning(
                "%s: its %s of %d bytes is more than this process may use (%d bytes, %s): the "
                "kernel would kill it before it refuses anything",
                task,
                what,
                size,
                limit[0],
                limit[1],
            )


class ParameterServer(ServerBase):
    """A ps task: ``Server(spec, "ps", k)`` builds one; tests may too. Its operations
    (``POST /v1/<op>`` or the stream) are those of ``operations.py``,
    ``checkpoint_operations.py`` and ``placement_map.py`` routed here and in the modules
    beside this one; one that names its coordinator (``owner``) is refused if a newer
    coordinator took this ps over from that one."""

    #: Arrays this ps makes start on a cache line (rows of 64 bytes' multiples are read
    #: and written in the fewest lines): its handlers run in a context with that allocator.
    setup_context = staticmethod(KERNELS.aligned_allocations)

    def __init__(
        self,
        index: int,
        *,
        allow_pickle: bool = True,
        max_variable_bytes: int = DEFAULT_MAX_VARIABLE_BYTES,
        max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_store_bytes: int | None = None,
        checkpoint_root: str | None = None,
        memory_budget: int | str | None = None,
        table_dir: str | None = None,
        table_segment_rows: int = 1 << 20,
        client_ssl: ssl.SSLContext | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__("ps", index, **kwargs)
        max_variable_bytes = byte_size(max_variable_bytes, "max_variable_bytes")
        max_gather_bytes = byte_size(max_gather_bytes, "max_gather_bytes")
        max_reply_bytes = byte_size(max_reply_bytes, "max_reply_bytes")
        if max_store_bytes is not None:
            max_store_bytes = byte_size(max_store_bytes, "max_store_bytes")
        #: TLS of this ps's own requests to other ps (a move's copy, pulled from its source).
        self.client_ssl = client_ssl
        # Every part is wired here, at construction, and reads the ps's name from it (a ps
        # that joined a job takes the index its coordinator gives it: ``renamed``).
        self.store = VariableStore(self)
        self.allow_pickle = allow_pickle
        self.max_variable_bytes = max_variable_bytes
        self.max_gather_bytes = max_gather_bytes
        self.max_reply_bytes = max_reply_bytes
        #: Bytes of variables this ps holds at most (creations past it are refused).
        limit = memory_limit()  # (read once: /proc's cgroup files)
        self.max_store_bytes = max_store_bytes or default_max_store_bytes(limit)
        self.checkpoints = ps_checkpoint.CheckpointFiles(
            self.store, checkpoint_root, max_variable_bytes, self.max_store_bytes
        )
        tiered = tier_directory(memory_budget, table_dir, table_segment_rows)
        tiering: Tiering | None = None
        #: The directory of this ps's rows on disk, locked while it lives (None: not tiered).
        self._tier_directory: TierDirectory | None = None
        if tiered is not None:  # its saves stage a share of its budget at a time
            tiering, self._tier_directory = tiered
            self.checkpoints.staging = tiering.save_bytes
        _warn_past_memory_limit(
            self.task,
            limit,
            {
                "memory budget (--memory-budget)": None if tiering is None else tiering.budget,
                "bytes of variables held at most (--max-store-bytes)": max_store_bytes,
            },
        )
        #: The serving feed of the tables (``GET /v1/tables/<name>/rows``).
        self.feed = TableFeed(self, {}, functools.partial(self.checkpoints.confine, what="table feed: file"))
        self.download(FEED_PATH, self.feed.serve)
        self.tables = self.feed.tables
        #: The slices each table serves here, for the tables part of which moved.
        guards = SliceGuards(self.store)
        #: What a rerun of an exactly-once closure reads: the values its dead attempt read.
        self.before_images = BeforeImages(self.store, self.tables)
        #: Fences, superseded coordinators and exactly-once keys: who may still write here.
        self.fencing = Fencing(
            self,
            scope_of=functools.partial(table_scope, guards, self.feed),
            before_update=self.before_images.capture,
        )
        self.table_handlers = TableHandlers(
            self,
            self.checkpoints,
            max_gather_bytes,
            self.feed,
            guards,
            max_table_bytes=max_variable_bytes,
            max_store_bytes=self.max_store_bytes,
            on_takeover=self.fencing.supersede,
            as_of=self.before_images.table_rows,
            tiering=tiering,
            spawn=self.tasks.spawn,
        )
        self.route(CreateVariables, self.create)
        self.route(ReadVariables, self.read)
        self.route(Fence, self.fencing.fence)
        self.route(UpdateVariables, self.fencing.guarded(self.update))
        for cls in SINGLE_UPDATES.values():
            self.route(cls, self.fencing.guarded(self.single_update))
        self.route(SparseRead, self.sparse_read)
        self.route(DeleteVariables, self.delete)
        self.route(ListVariables, self.list_variables)
        in_ram = self.table_handlers.rows_in_ram  # rows on disk read back first, off the loop
        self.route(
            ApplyGradients,
            in_ram(
                self.fencing.guarded(self.apply_optimizer),
                lambda req: [(n, i) for n, i, _ in req.table_gradients()],
                check=lambda req: self.table_handlers.check_gradients(req.table_gradients(), held=False),
            ),
        )
        if tiering is not None:  # variables and their slots count against the budget too
            self.store.budget = Budget(
                tiering.limit, self.table_handlers.held, self.table_handlers.give_room, tiering.budget
            )
        self.table_handlers.install(self.route)
        # tables and variables: both halves here
        self.route(
            LookupTables,
            in_ram(
                self.lookup_tables,
                lambda req: [(x.name, x.ids) for x in req.lookups],
                lambda req: req.train,
                self._check_lookup_tables,
            ),
        )
        #: Variables and table slices moving in and out (an elastic ps joined or leaves).
        self.moves = Moves(
            self.store, self.fencing, self.max_store_bytes, self.table_handlers, self._channel_to_ps
        )
        self.moves.install_routes(self.route)
        self.deltas = Deltas(self.checkpoints, self.feed, self.incarnation)
        self.deltas.install(self.route)
        self.route(RestoreCheckpoint, self.restore_checkpoint)
        self.route(CommitRestore, self.commit_restore)
        self.route(AbortRestore, self.abort_restore)
        if allow_pickle:
            self.route(CallVariables, self.fencing.guarded(self.call_function, once=False))
        else:
            self.refuse(
                CallVariables,
                f"{self.task} refuses pickled functions (started with "
                "--no-pickle): strategy.extended.update cannot run here",
            )

    def route(self, operation: type[Operation[R]], fn: HandlerFn[R]) -> None:
        if "owner" in operation.__struct_fields__ and not issubclass(operation, Mutation):
            # (an update checks it behind its fence) a zombie coordinator changes nothing here
            fn = self.fencing.owned(fn, operation.op())
        super().route(operation, fn)

    def _channel_to_ps(self, address: str, index: int) -> Channel:
        """A channel from this ps to ps ``index`` at ``address``, with this ps's token. A ps
        that serves TLS expects the other ps to (a cluster is TLS or not as a whole), and
        verifies them with ``--tls-ca``: without one, FailedPreconditionError says so."""
        if self.ssl_context is not None and self.client_ssl is None:
            raise FailedPreconditionError(
                f"{self.task} serves TLS but has no CA to verify ps {index} at {address} with "
                "(pstrain serve --tls-ca FILE): it cannot copy variables moving to it from there"
            )
        return Channel(
            address,
            token=self.token,
            task=task_name("ps", index),
            ssl_context=self.client_ssl,
            max_body=self.max_body,
        )

    def renamed(self, index: int) -> None:
        """Answer to ps ``index`` from now on: the index the coordinator this ps joined gave
        it (``pstrain serve --role ps --join``), in its errors, logs and table feed too."""
        self.index, self.answers_any_index = index, False  # its parts read the name from it

    async def on_stop(self) -> None:
        self.checkpoints.hurry(stop=True)  # a delta spread over some seconds: the rest at once
        if self._tier_directory is not None:  # the rows on disk live as long as the ps
            self._tier_directory.remove()

    # -- create / delete / list ----------------------------------------------------------------
    async def create(self, req: CreateVariables) -> CreatedReply:
        """Create variables, all or none. Initializers run off the serving loop."""
        names: set[str] = set()
        planned = []
        adding = sum(math.prod(s.shape) * itemsize(s.dtype) for s in req.vars)
        per_request = max(self.max_variable_bytes, CREATE_CHUNK_BYTES)
        if len(req.vars) > 1 and adding > per_request:
            raise InvalidArgumentError(
                f"vars/create: {len(req.vars)} variables of {adding} bytes in all in one request, "
                f"more than this ps's limit of {per_request} bytes per request (pstrain serve "
                "--max-variable-bytes): send them in several requests"
            )
        held = self.table_handlers.held()  # (variables and tables)
        if held + adding > self.max_store_bytes:
            raise ResourceExhaustedError(
                f"vars/create: {adding} more bytes of variables would take {self.task} past its "
                f"limit of {self.max_store_bytes} bytes held ({held} held now; pstrain serve "
                "--max-store-bytes): shard over more ps, or raise the limit"
            )
        self.store.check_budget(  # (a new coordinator's variables replace its predecessor's)
            adding - sum(self.store.footprint(s.name) for s in req.vars),
            f"vars/create of {', '.join(repr(s.name) for s in req.vars)}",
        )
        for spec in req.vars:
            if spec.name in names:
                raise AlreadyExistsError(f"variable {spec.name!r} is created twice in one request")
            self.store.taken_over(VariableRecord(spec.name, _EMPTY, spec.trainable, req.owner))
            names.add(spec.name)
            planned.append(plan_create(spec, self.max_variable_bytes))
        needs_work = [i for i, (_, make) in enumerate(planned) if make is not None]
        arrays: list[np.ndarray | None] = [array for array, _ in planned]
        if needs_work:

            def build() -> list[np.ndarray]:
                return [planned[i][1]() for i in needs_work]  # type: ignore[misc]

            built = await asyncio.to_thread(build)  # in this context: its allocator
            for i, array in zip(needs_work, built):
                arrays[i] = array
        records = [
            VariableRecord(
                spec.name,
                array,  # type: ignore[arg-type]
                spec.trainable,
                req.owner,
                initial=make,
            )
            for spec, array, (_, make) in zip(req.vars, arrays, planned)
        ]
        replaced = self.store.add(records)  # checked again: the initializers ran concurrently
        if replaced:
            self.fencing.supersede({r.owner for r in replaced}, req.owner)
            logger.warning(
                "%s: %d variable(s) taken over by a new coordinator (strategy %s), "
                "replacing those of %s, with their optimizer slots: %s",
                self.task,
                len(replaced),
                req.owner,
                sorted({str(r.owner) for r in replaced}),
                ", ".join(r.name for r in replaced[:10]),
            )
        return CreatedReply(created=len(records))

    def delete(self, req: DeleteVariables) -> DeletedReply:
        return DeletedReply(deleted=self.store.delete(req.names))

    def list_variables(self, req: ListVariables) -> ListReply:
        return ListReply(
            variables=[
                VariableInfo(
                    name=r.name,
                    dtype=r.dtype.str,
                    shape=list(r.shape),
                    trainable=r.trainable,
                    nbytes=r.nbytes,
                )
                for r in self.store
            ]
        )

    # -- reads ---------------------------------------------------------------------------------
    def read(self, req: ReadVariables) -> Pinned[ValuesReply]:
        """The variables named, whole (pinned, not copied). A name may appear once, and the
        reply is at most ``max_reply_bytes``: what a request makes the ps send follows what
        the ps holds, never how often a short request repeats a name."""
        if len(set(req.names)) != len(req.names):
            twice = next(n for i, n in enumerate(req.names) if n in req.names[:i])
            raise InvalidArgumentError(
                f"vars/read: variable {twice!r} is named more than once (name each variable once)"
            )
        records = [self.store.get(n) for n in req.names]
        total = sum(r.array.nbytes for r in records)
        if total > self.max_reply_bytes:
            raise InvalidArgumentError(
                f"vars/read: the reply would be {total} bytes, more than this ps's limit of "
                f"{self.max_reply_bytes} (pstrain serve --max-reply-bytes): read the variables "
                "in several requests of fewer variables"
            )
        releases = [r.pin() for r in records]

        def release() -> None:
            for r in releases:
                r()

        values = [r.array for r in records]
        if req.as_of is not None:  # a read of an exactly-once closure (a rerun's, maybe)
            values = [self.before_images.whole(n, req.as_of, v) for n, v in zip(req.names, values)]
        return Pinned(ValuesReply(values=values), release)

    def sparse_read(self, req: SparseRead) -> ValuesReply | Pinned[ValuesReply]:
        """Rows of variables (copied), and whole variables (``indices`` None; pinned, not
        copied): one request reads a step's rows of every table and its dense variables.
        The rows of ``packed`` come back as one array, after the values of ``reads``."""
        op = "vars/sparse_read"
        if req.reads is not None or req.packed is not None:
            if req.name is not None or req.indices is not None:
                raise InvalidArgumentError(f"{op}: give 'reads' (or 'packed'), or 'name' and 'indices'")
            reads: list[tuple[str, np.ndarray | None]] = [(r.name, r.indices) for r in req.reads or ()]
        elif req.name is not None and req.indices is not None:
            reads = [(req.name, req.indices)]
        else:
            raise InvalidArgumentError(f"{op}: give 'reads' (or 'packed'), or 'name' and 'indices'")
        packed: list[tuple[str, np.ndarray | None]] = (
            [(name, rows) for name, rows, _ in req.packed.entries(op)] if req.packed is not None else []
        )
        planned = self._plan_reads(reads + packed, op)
        if packed:
            rows = {(record.array.dtype, record.array.shape[1:]) for record, _ in planned[len(reads) :]}
            if len(rows) != 1:
                raise InvalidArgumentError(
                    f"{op}: packed rows are read into one array: their variables' dtypes and row "
                    f"shapes must agree (got {sorted((str(d), list(s)) for d, s in rows)})"
                )
        return self._reads(planned, [], req.as_of, packed=len(packed))

    def _check_lookup_tables(self, req: LookupTables) -> None:
        """What :meth:`lookup_tables` refuses whatever the rows (a tiered ps asks first)."""
        self._plan_reads([(r.name, r.indices) for r in req.reads or ()], "dyn/lookup_many")
        self.table_handlers.check_lookups(
            [(x.name, x.ids) for x in req.lookups], "dyn/lookup_many", held=False
        )

    def lookup_tables(self, req: LookupTables) -> ValuesReply | Pinned[ValuesReply]:
        """``dyn/lookup_many``: dynamic tables' rows and variables' reads in one request; all
        of it checked before a table admits a row."""
        planned = self._plan_reads([(r.name, r.indices) for r in req.reads or ()], "dyn/lookup_many")
        tables = self.table_handlers.lookup_tables(req).values
        return self._reads(planned, tables, req.as_of)

    def _plan_reads(
        self, reads: list[tuple[str, np.ndarray | None]], op: str
    ) -> list[tuple[VariableRecord, np.ndarray | None]]:
        """``reads`` checked (names, rows, the reply's size), nothing read yet."""
        planned: list[tuple[VariableRecord, np.ndarray | None]] = []
        gathered = whole = 0
        wholes: set[str] = set()
        for name, indices in reads:
            record = self.store.get(name)
            if indices is None:
                if name in wholes:
                    raise InvalidArgumentError(
                        f"{op}: variable {name!r} is read whole more than once (name each variable once)"
                    )
                wholes.add(name)
                whole += record.array.nbytes
                planned.append((record, None))
                continue
            idx = checked_rows(record, indices, "sparse_read")
            gathered += idx.size * (record.array.nbytes // max(1, record.array.shape[0]))
            planned.append((record, idx))
        if gathered > self.max_gather_bytes:
            raise InvalidArgumentError(
                f"{op}: the reply would be {gathered} bytes, more than this ps's limit of "
                f"{self.max_gather_bytes} (ask for unique rows, in smaller requests)"
            )
        if whole > self.max_reply_bytes:
            raise InvalidArgumentError(
                f"{op}: the whole variables would be {whole} bytes, more than this ps's limit of "
                f"{self.max_reply_bytes} (pstrain serve --max-reply-bytes)"
            )
        return planned

    def _reads(
        self,
        planned: list[tuple[VariableRecord, np.ndarray | None]],
        first: list[Any],
        as_of: Any,
        packed: int = 0,
    ) -> ValuesReply | Pinned[ValuesReply]:
        """The reply: ``first`` (values already made), then ``planned``'s reads: rows copied,
        whole variables pinned until the reply is sent; the rows of the last ``packed``
        reads (of one dtype and row shape) gathered into one array."""
        cut = len(planned) - packed
        values = [
            record.array if idx is None else take_rows(record.array, idx) for record, idx in planned[:cut]
        ]
        views: list[np.ndarray] = []
        if packed:
            like = planned[cut][0].array
            sizes = [idx.shape[0] for _, idx in planned[cut:]]  # type: ignore[union-attr]
            rows = np.empty((sum(sizes), *like.shape[1:]), like.dtype)
            start = 0
            for (record, idx), size in zip(planned[cut:], sizes):
                views.append(take_rows(record.array, idx, out=rows[start : start + size]))  # type: ignore[arg-type]
                start += size
            values.append(rows)
        if as_of is not None:  # a read of an exactly-once closure (a rerun's, maybe)
            values[:cut] = [
                self.before_images.whole(record.name, as_of, v)
                if idx is None
                else self.before_images.rows(record.name, as_of, idx, v)
                for (record, idx), v in zip(planned[:cut], values[:cut])
            ]
            for (record, idx), view in zip(planned[cut:], views):
                assert idx is not None  # (packed reads are of rows)
                before = self.before_images.rows(record.name, as_of, idx, view)
                if before is not view:
                    view[...] = before
        if all(idx is not None for _, idx in planned):
            return ValuesReply(values=first + values)
        releases = [record.pin() for record, idx in planned if idx is None]

        def release() -> None:
            for r in releases:
                r()

        return Pinned(ValuesReply(values=first + values), release)

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out["variables"] = len(self.store)
        out["bytes"] = self.store.nbytes
        out.update(self.moves.statistics())
        if len(self.before_images):  # kept for reruns of exactly-once closures
            out["before_images"] = {"count": len(self.before_images), "bytes": self.before_images.nbytes}
        if self.tables:
            out["tables"] = {name: t.statistics() for name, t in self.tables.items()}
        return out

    # -- updates -------------------------------------------------------------------------------
    def single_update(self, req: SingleUpdate) -> UpdatedReply:
        """One variable's update, the kind its class says (``vars/assign`` ...)."""
        self._plan(req.kind, req)()
        return UpdatedReply(updated=1)

    def update(self, req: UpdateVariables) -> UpdatedReply:
        """Apply a batch of updates, all or nothing."""
        plan = [self._plan(entry.op, entry) for entry in req.updates]  # raises before anything changes
        for apply in plan:
            apply()
        return UpdatedReply(updated=len(plan))

    def _plan(self, kind: UpdateKind, entry: Update | SingleUpdate) -> Callable[[], None]:
        record = self.store.get(entry.name)
        shape = record.array.shape
        dtype = record.array.dtype
        op = kind.value  # for messages
        if kind in (UpdateKind.ASSIGN, UpdateKind.ASSIGN_ADD, UpdateKind.ASSIGN_SUB):
            value = checked_value(record, entry.value, shape, op)
            if kind is UpdateKind.ASSIGN:

                def apply() -> None:
                    if value.dtype == dtype and value.flags.writeable and value.base is not None:
                        record.replace(value)  # adopt the received buffer: no copy (where it starts)
                    else:
                        record.replace(value.astype(dtype))

                return apply
            sign = 1 if kind is UpdateKind.ASSIGN_ADD else -1

            def apply() -> None:
                arr = record.writable()
                if sign > 0:
                    np.add(arr, value, out=arr)
                else:
                    np.subtract(arr, value, out=arr)

            return apply
        idx = checked_rows(record, entry.indices, op)
        if idx.ndim != 1:
            raise InvalidArgumentError(
                f"{op} of variable {record.name!r}: row ids must be 1-D, got shape {idx.shape}"
            )
        values = checked_value(record, entry.values, (idx.shape[0],) + shape[1:], op)
        scatter_rule.check(op, dtype, record.name)

        def scatter_rows() -> None:
            scatter_rule.scatter(record.writable(idx), idx, values, op)

        return scatter_rows

    # -- optimizers and functions run where the variables live (compute.py) ----------------------
    def apply_optimizer(self, req: ApplyGradients) -> StepReply:
        return apply_gradients(self.store, self.table_handlers, req)

    def call_function(self, req: CallVariables) -> CallReply:
        return call_function(self.store, req)

    async def restore_checkpoint(self, req: RestoreCheckpoint) -> RestoreReply:
        """Read variables from checkpoint files; with ``stage``, hold them until committed."""
        return await self.checkpoints.restore(req)

    def commit_restore(self, req: CommitRestore) -> CommitReply:
        """Put a staged restore in place, its variables and its tables (each with the share
        of its capacity ``req.tables`` gives it), all checked before any changes; the reply
        names this ps's incarnation, which the coordinator then knows holds restored state
        (a restart followed by a restore)."""
        install_tables = self.table_handlers.restores.commit_tables(req.stage, req.tables)
        if req.stage in self.table_handlers.restores.staged and not self.checkpoints.has_stage(req.stage):
            restored = 0  # tables only
        else:
            restored = self.checkpoints.commit(req.stage)
        return CommitReply(restored=restored + install_tables(), incarnation=self.incarnation)

    async def abort_restore(self, req: AbortRestore) -> AbortReply:
        tables = self.table_handlers.restores.abort_tables(req.stage)
        await self.table_handlers.restores.asides.brought_back()  # (served again before the reply)
        aborted = await self.checkpoints.abort(req.stage)
        return AbortReply(aborted=aborted or tables)
