"""The parameter server: the handlers that read and update its variable store.

Every request arrives as its declared record (``schemas.py``), already
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
``ps_checkpoint.py``. ``allow_pickle=False`` refuses ``vars/call`` (the only
operation that runs a caller's function) before anything is decoded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ..._base.errors import AlreadyExistsError, CancelledError, InvalidArgumentError
from ..._formats import initializers
from ..._formats.casting import NUMERIC_KINDS, cast_value
from ..._formats.optimizer_rules import RULES, slot_specs
from ..._formats.schedules import from_spec
from ..._formats.schemas import (
    CREATE_CHUNK_BYTES,
    ApplyRequest,
    CallRequest,
    CreateRequest,
    Empty,
    FenceRequest,
    NamesRequest,
    RestoreRequest,
    SaveRequest,
    SingleUpdate,
    SparseReadRequest,
    StageRequest,
    Update,
    UpdateRequest,
    VariableSpec,
)
from ..._serving.base import ServerBase
from ..._serving.core import Pinned
from . import checkpoint as ps_checkpoint
from .store import VariableRecord, VariableStore
from .tables import TableHandlers

#: Exactly-once closures remembered by a ps (their keys, oldest forgotten first).
ONCE_WINDOW = 100_000
#: Superseded coordinator incarnations a ps remembers (each a takeover).
SUPERSEDED_WINDOW = 1024

_EMPTY = np.zeros(0)  # the array of a record built only to check a name

logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]

UPDATE_OPS = ("assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub",
              "scatter_update")
#: Default largest variable a ps creates (its initializer or value), in bytes.
DEFAULT_MAX_VARIABLE_BYTES = 512 << 20
#: Default largest reply that copies data (gathered rows), in bytes.
DEFAULT_MAX_GATHER_BYTES = 32 << 20
#: Default largest reply of whole variables (``vars/read``), in bytes.
DEFAULT_MAX_REPLY_BYTES = 1 << 30


def default_max_store_bytes() -> int:
    """Default bytes of variables (and staged restores) a ps holds: 80 % of the machine's memory."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not on Linux
        return 1 << 40


class ParameterServer(ServerBase):
    """A ps task: ``Server(spec, "ps", k)`` builds one; tests may too.

    Operations (``POST /v1/<op>`` or the stream): ``vars/create``,
    ``vars/read``, ``vars/update`` (batched), ``vars/assign``,
    ``vars/assign_add``, ``vars/assign_sub``, ``vars/scatter_add``,
    ``vars/scatter_update``, ``vars/sparse_read``, ``vars/delete``,
    ``vars/list``, ``opt/apply``, ``ckpt/save``, ``ckpt/restore`` (staged, then
    ``ckpt/commit`` or ``ckpt/abort``), ``vars/call``, plus ``health`` and
    ``statistics``.
    """

    def __init__(self, index: int, *, allow_pickle: bool = True,
                 max_variable_bytes: int = DEFAULT_MAX_VARIABLE_BYTES,
                 max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
                 max_store_bytes: int | None = None,
                 checkpoint_root: str | None = None, **kwargs: Any) -> None:
        super().__init__("ps", index, **kwargs)
        self.store = VariableStore(self.task)
        self.allow_pickle = allow_pickle
        self.max_variable_bytes = max_variable_bytes
        self.max_gather_bytes = max_gather_bytes
        self.max_reply_bytes = max_reply_bytes
        #: Bytes of variables this ps holds at most (creations past it are refused).
        self.max_store_bytes = max_store_bytes or default_max_store_bytes()
        self.checkpoints = ps_checkpoint.CheckpointFiles(self.store, checkpoint_root,
                                                         max_variable_bytes)
        self.checkpoints.max_store_bytes = self.max_store_bytes
        self.route("vars/create", self.create)
        self.route("vars/read", self.read)
        #: (owner, worker) -> the first epoch of that worker's dispatches accepted from that
        #: coordinator incarnation: a new coordinator starts with no fences of its own.
        self.fences: dict[tuple[str | None, int], int] = {}
        #: Coordinator incarnations a newer one took over from (their variables replaced):
        #: every update they still send is refused (a zombie coordinator cannot write).
        self.superseded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._done: collections.OrderedDict[str, dict[int, Any]] = collections.OrderedDict()
        self.route("ps/fence", self.fence)
        self.route("vars/update", self._guarded(self.update))
        for op in UPDATE_OPS:
            self.route(f"vars/{op}", self._guarded(self._single_update(op)))
        self.route("vars/sparse_read", self.sparse_read)
        self.route("vars/delete", self.delete)
        self.route("vars/list", self.list_variables)
        self.route("opt/apply", self._guarded(self.apply_optimizer))
        self.table_handlers = TableHandlers(self.task, self.checkpoints, max_gather_bytes,
                                            max_table_bytes=max_variable_bytes,
                                            on_takeover=self._supersede)
        self.tables = self.table_handlers.tables
        for op, handler in self.table_handlers.routes().items():
            self.route(op, handler)
        self.route("ckpt/save", self.save_checkpoint)
        self.route("ckpt/restore", self.restore_checkpoint)
        self.route("ckpt/commit", self.commit_restore)
        self.route("ckpt/abort", self.abort_restore)
        if allow_pickle:
            self.route("vars/call", self._guarded(self.call_function, once=False), pickle=True)
        else:
            self.refuse("vars/call", f"{self.task} refuses pickled functions (started with "
                                     "--no-pickle): strategy.extended.update cannot run here")

    # -- fencing and exactly-once ------------------------------------------------------------------
    def fence(self, req: FenceRequest) -> dict[str, Any]:
        """From now on, refuse updates sent for ``owner`` by ``worker``'s dispatches before
        ``epoch`` (that coordinator declared it lost: its closures run elsewhere)."""
        self._refuse_superseded(req.owner, f"a fence of worker {req.worker}")
        key = (req.owner, req.worker)
        self.fences[key] = max(self.fences.get(key, 0), req.epoch)
        return {"fenced": self.fences[key]}

    def _supersede(self, owners: set[str | None], by: str | None) -> None:
        """A coordinator ``by`` took over variables or tables of ``owners``: from now on
        their updates are refused, and their fences are dropped."""
        for owner in owners - {None, by}:
            assert owner is not None
            self.superseded[owner] = None
            self.superseded.move_to_end(owner)
            while len(self.superseded) > SUPERSEDED_WINDOW:
                self.superseded.popitem(last=False)
            for key in [k for k in self.fences if k[0] == owner]:
                del self.fences[key]

    def _refuse_superseded(self, owner: str | None, what: str) -> None:
        if owner is not None and owner in self.superseded:
            raise CancelledError(
                f"{self.task} refused {what} from coordinator {owner[:8]}: a newer coordinator "
                "took this ps over (the old one must stop; its work is the new one's now)")

    def _guarded(self, fn: Callable[[Any], dict[str, Any]], once: bool = True
                 ) -> Callable[[Any], dict[str, Any]]:
        """``fn`` behind the fence, and, with ``once``, applied once per exactly-once key and
        sequence number (a retry gets the first attempt's reply)."""
        def handler(req: Any) -> dict[str, Any]:
            self._refuse_superseded(req.owner, "an update")
            fence = req.fence
            if fence is not None and fence[1] < self.fences.get((req.owner, fence[0]), 0):
                raise CancelledError(
                    f"{self.task} refused an update of worker {fence[0]}'s dispatch {fence[1]}: the "
                    f"coordinator declared that worker lost (its work runs elsewhere)")
            key = req.once if once else None
            if key is not None:
                done = self._done.get(key[0])
                if done is not None and key[1] in done:
                    self._done.move_to_end(key[0])
                    return done[key[1]]  # applied by an earlier attempt of this closure
            reply = fn(req)
            if key is not None:
                self._done.setdefault(key[0], {})[key[1]] = reply
                self._done.move_to_end(key[0])
                while len(self._done) > ONCE_WINDOW:
                    self._done.popitem(last=False)
            return reply

        handler.__name__ = getattr(fn, "__name__", "update")
        return handler

    # -- checks ---------------------------------------------------------------------------------
    def _value(self, record: VariableRecord, value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        if value is None:
            raise InvalidArgumentError(f"{what} of variable {record.name!r}: missing value")
        arr = cast_value(value, record.array.dtype, f"{what} of variable {record.name!r}")
        if arr.shape != shape:
            raise InvalidArgumentError(
                f"{what} of variable {record.name!r}: value has shape {arr.shape}, expected {shape}")
        return arr

    def _rows(self, record: VariableRecord, idx: Any, what: str) -> np.ndarray:
        if idx is None:
            raise InvalidArgumentError(f"{what} of variable {record.name!r}: missing row ids")
        if idx.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{what} of variable {record.name!r}: row ids must be integers, got {idx.dtype}")
        if record.array.ndim == 0:
            raise InvalidArgumentError(f"{what}: variable {record.name!r} is a scalar and has no rows")
        n = record.array.shape[0]
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = idx[(idx < 0) | (idx >= n)].reshape(-1)[0]
            raise InvalidArgumentError(
                f"{what} of variable {record.name!r}: row id {int(bad)} out of range [0, {n})")
        return idx

    # -- create / delete / list ----------------------------------------------------------------
    async def create(self, req: CreateRequest) -> dict[str, Any]:
        """Create variables, all or none. Initializers run off the serving loop."""
        names: set[str] = set()
        planned = []
        adding = sum(math.prod(s.shape) * _itemsize(s.dtype) for s in req.vars)
        per_request = max(self.max_variable_bytes, CREATE_CHUNK_BYTES)
        if len(req.vars) > 1 and adding > per_request:
            raise InvalidArgumentError(
                f"vars/create: {len(req.vars)} variables of {adding} bytes in all in one request, "
                f"more than this ps's limit of {per_request} bytes per request (pstrain serve "
                "--max-variable-bytes): send them in several requests")
        held = self.store.nbytes + self.checkpoints.staged_bytes()
        if held + adding > self.max_store_bytes:
            raise InvalidArgumentError(
                f"vars/create: {adding} more bytes of variables would take {self.task} past its "
                f"limit of {self.max_store_bytes} bytes held ({held} held now; pstrain serve "
                "--max-store-bytes): shard over more ps, or raise the limit")
        for spec in req.vars:
            if spec.name in names:
                raise AlreadyExistsError(f"variable {spec.name!r} is created twice in one request")
            self.store.taken_over(VariableRecord(spec.name, _EMPTY, spec.trainable, req.owner))
            names.add(spec.name)
            planned.append(self._plan_create(spec))
        needs_work = [i for i, (_, make) in enumerate(planned) if make is not None]
        arrays: list[np.ndarray | None] = [array for array, _ in planned]
        if needs_work:
            def build() -> list[np.ndarray]:
                return [planned[i][1]() for i in needs_work]  # type: ignore[misc]

            built = await asyncio.get_running_loop().run_in_executor(None, build)
            for i, array in zip(needs_work, built):
                arrays[i] = array
        records = [VariableRecord(spec.name, array, spec.trainable, req.owner)  # type: ignore[arg-type]
                   for spec, array in zip(req.vars, arrays)]
        replaced = self.store.add(records)  # checked again: the initializers ran concurrently
        if replaced:
            self._supersede({r.owner for r in replaced}, req.owner)
            logger.warning("%s: %d variable(s) taken over by a new coordinator (strategy %s), "
                           "replacing those of %s, with their optimizer slots: %s", self.task,
                           len(replaced), req.owner, sorted({str(r.owner) for r in replaced}),
                           ", ".join(r.name for r in replaced[:10]))
        return {"created": len(records)}

    def _plan_create(self, spec: VariableSpec) -> tuple[np.ndarray | None, Callable[[], np.ndarray] | None]:
        """(the array, or None and a function that builds it off the loop)."""
        where = f"vars/create {spec.name!r}"
        try:
            dtype = np.dtype(spec.dtype)
        except TypeError as exc:
            raise InvalidArgumentError(f"{where}: bad dtype {spec.dtype!r}") from exc
        if dtype.kind not in NUMERIC_KINDS or dtype.hasobject:
            raise InvalidArgumentError(f"{where}: dtype {dtype} is not numeric")
        shape = tuple(spec.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.max_variable_bytes:
            raise InvalidArgumentError(
                f"{where}: {nbytes} bytes is more than this ps's limit of {self.max_variable_bytes} "
                "bytes per variable (pstrain serve --max-variable-bytes); shard it "
                "(variable_partitioner) or raise the limit")
        if (spec.value is None) == (spec.init is None):
            raise InvalidArgumentError(f"{where}: give exactly one of 'value' and 'init'")
        if spec.init is not None:
            init = initializers.from_spec(spec.init)
            try:  # a one-element probe: bad parameters are the caller's error, found now
                init((1,), dtype)
            except InvalidArgumentError:
                raise
            except Exception as exc:
                raise InvalidArgumentError(f"{where}: bad initializer {spec.init!r}: {exc}") from None
            offset, full_shape = spec.offset, spec.full_shape
            if offset is not None and len(offset) != len(shape):
                raise InvalidArgumentError(f"{where}: offset {offset} does not match shape {shape}")
            if full_shape is not None and (len(full_shape) != len(shape) or any(
                    (o or 0) + s > f for o, s, f in zip(offset or [0] * len(shape), shape, full_shape))):
                raise InvalidArgumentError(f"{where}: part {shape} at {offset} is not inside {full_shape}")
            return None, lambda: init(shape, dtype, offset=offset, full_shape=full_shape)
        value = spec.value
        assert value is not None
        if value.shape != shape:
            raise InvalidArgumentError(f"{where}: value has shape {value.shape}, declared {shape}")
        arr = cast_value(value, dtype, where)
        if arr is value and not arr.flags.writeable:
            arr = arr.copy()
        return arr, None

    def delete(self, req: NamesRequest) -> dict[str, Any]:
        return {"deleted": self.store.delete(req.names)}

    def list_variables(self, req: Empty) -> dict[str, Any]:
        return {"variables": [
            {"name": r.name, "dtype": r.array.dtype.str, "shape": r.array.shape,
             "trainable": r.trainable, "nbytes": r.array.nbytes}
            for r in self.store]}

    # -- reads ---------------------------------------------------------------------------------
    def read(self, req: NamesRequest) -> Pinned:
        """The variables named, whole (pinned, not copied). A name may appear once, and the
        reply is at most ``max_reply_bytes``: what a request makes the ps send follows what
        the ps holds, never how often a short request repeats a name."""
        if len(set(req.names)) != len(req.names):
            twice = next(n for i, n in enumerate(req.names) if n in req.names[:i])
            raise InvalidArgumentError(f"vars/read: variable {twice!r} is named more than once "
                                       "(name each variable once)")
        records = [self.store.get(n) for n in req.names]
        total = sum(r.array.nbytes for r in records)
        if total > self.max_reply_bytes:
            raise InvalidArgumentError(
                f"vars/read: the reply would be {total} bytes, more than this ps's limit of "
                f"{self.max_reply_bytes} (pstrain serve --max-reply-bytes): read the variables "
                "in several requests of fewer variables")
        releases = [r.pin() for r in records]

        def release() -> None:
            for r in releases:
                r()

        return Pinned({"values": [r.array for r in records]}, release)

    def sparse_read(self, req: SparseReadRequest) -> dict[str, Any]:
        if req.reads is not None:
            if req.name is not None or req.indices is not None:
                raise InvalidArgumentError("vars/sparse_read: give 'reads', or 'name' and 'indices'")
            reads: list[tuple[str, np.ndarray | None]] = [(r.name, r.indices) for r in req.reads]
        elif req.name is not None:
            reads = [(req.name, req.indices)]
        else:
            raise InvalidArgumentError("vars/sparse_read: give 'reads', or 'name' and 'indices'")
        planned = []
        total = 0
        for name, indices in reads:
            record = self.store.get(name)
            idx = self._rows(record, indices, "sparse_read")
            total += idx.size * (record.array.nbytes // max(1, record.array.shape[0]))
            planned.append((record, idx))
        if total > self.max_gather_bytes:
            raise InvalidArgumentError(
                f"vars/sparse_read: the reply would be {total} bytes, more than this ps's limit of "
                f"{self.max_gather_bytes} (ask for unique rows, in smaller requests)")
        return {"values": [record.array[idx] for record, idx in planned]}

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out["variables"] = len(self.store)
        out["bytes"] = self.store.nbytes
        if self.tables:
            out["tables"] = {name: t.statistics() for name, t in self.tables.items()}
        return out

    # -- updates -------------------------------------------------------------------------------
    def _single_update(self, op: str) -> Callable[[SingleUpdate], dict[str, Any]]:
        def handler(req: SingleUpdate) -> dict[str, Any]:
            self._plan(op, req)()
            return {"updated": 1}

        handler.__name__ = f"update_{op}"
        return handler

    def update(self, req: UpdateRequest) -> dict[str, Any]:
        """Apply a batch of updates, all or nothing."""
        plan = [self._plan(entry.op, entry) for entry in req.updates]  # raises before anything changes
        for apply in plan:
            apply()
        return {"updated": len(plan)}

    def _plan(self, op: str, entry: Update | SingleUpdate) -> Callable[[], None]:
        record = self.store.get(entry.name)
        shape = record.array.shape
        dtype = record.array.dtype
        if op in ("assign", "assign_add", "assign_sub"):
            value = self._value(record, entry.value, shape, op)
            if op == "assign":
                def apply() -> None:
                    if value.dtype == dtype and value.flags.writeable and value.base is not None:
                        record.replace(value)  # adopt the received buffer: no copy
                    else:
                        record.replace(value.astype(dtype))
                return apply
            sign = 1 if op == "assign_add" else -1

            def apply() -> None:
                arr = record.writable()
                if sign > 0:
                    np.add(arr, value, out=arr)
                else:
                    np.subtract(arr, value, out=arr)
            return apply
        idx = self._rows(record, entry.indices, op)
        if idx.ndim != 1:
            raise InvalidArgumentError(
                f"{op} of variable {record.name!r}: row ids must be 1-D, got shape {idx.shape}")
        values = self._value(record, entry.values, (idx.shape[0],) + shape[1:], op)
        if op == "scatter_update":
            def replace_rows() -> None:
                record.writable(idx)[idx] = values
            return replace_rows
        vals = values if op == "scatter_add" else -values

        def add_rows() -> None:
            np.add.at(record.writable(idx), idx, vals)
        return add_rows

    # -- optimizers and functions run where the variables live -------------------------------
    def apply_optimizer(self, req: ApplyRequest) -> dict[str, Any]:
        """Apply one optimizer step to the gradients of the variables on this ps, all or nothing.

        ``grads`` are ``[variable, rows | None, values]``. Slots live here as variables
        ``<prefix>/<slot>/<variable>`` and are created on first use. Everything (every
        gradient, ``iterations``, the slots to create) is checked before anything changes.
        """
        cfg = {k: v for k, v in msgspec.structs.asdict(req.rule).items() if v is not None}
        if not isinstance(req.rule.learning_rate, float):  # a schedule: checked whole, here
            cfg["learning_rate"] = msgspec.to_builtins(req.rule.learning_rate)
            schedule = from_spec(cfg["learning_rate"])
        else:
            schedule = None
        rule = RULES[req.rule.kind]
        specs = slot_specs(cfg)
        plan = []
        seen: set[str] = set()
        for name, rows, values in req.grads:
            if name in seen:
                raise InvalidArgumentError(f"opt/apply: two gradients for variable {name!r}")
            seen.add(name)
            record = self.store.get(name)
            if record.array.dtype.kind not in "fc":
                raise InvalidArgumentError(f"opt/apply: variable {name!r} of dtype "
                                           f"{record.array.dtype} cannot be trained")
            if rows is None:
                grad = self._value(record, values, record.array.shape, "gradient")
            else:
                rows = self._rows(record, rows, "sparse gradient")
                if rows.ndim != 1:
                    raise InvalidArgumentError(f"sparse gradient of {name!r}: rows must be 1-D")
                grad = self._value(record, values, (rows.shape[0],) + record.array.shape[1:],
                                   "sparse gradient")
                if not req.unique_rows or (rows.size > 1 and not bool(np.all(rows[1:] > rows[:-1]))):
                    rows, inverse = np.unique(rows, return_inverse=True)
                    summed = np.zeros((rows.shape[0],) + grad.shape[1:], record.array.dtype)
                    np.add.at(summed, inverse, grad)
                    grad = summed
            slots = {}
            for slot_name, init in specs.items():
                full = f"{req.prefix}/{slot_name}/{record.name}"
                existing = self.store.find(full)
                if existing is not None and (existing.array.shape != record.array.shape
                                             or existing.array.dtype != record.array.dtype):
                    raise InvalidArgumentError(f"opt/apply: slot {full!r} is {existing.array.shape} "
                                               f"{existing.array.dtype}, its variable "
                                               f"{record.array.shape} {record.array.dtype}")
                slots[slot_name] = (full, init)
            plan.append((record, rows, grad, slots))
        table_plan = self.table_handlers.plan(req.tables or (), req.prefix, specs)
        it_record = None
        if req.iterations is not None:
            it_record = self.store.get(req.iterations)
            if it_record.array.shape != () or it_record.array.dtype.kind not in "iu":
                raise InvalidArgumentError(f"opt/apply: {req.iterations!r} is not an integer "
                                           "scalar step counter")
        # -- commit: nothing below can fail on the request's account
        t = req.t
        if it_record is not None:
            counter = it_record.writable()
            counter += 1
            t = int(counter)
        step = int(t or 1)
        if schedule is not None:  # Keras reads the rate at iterations before the update
            cfg["learning_rate"] = schedule(step - 1)
        for record, rows, grad, slots in plan:
            var = record.writable(rows)
            arrays = {s: self.store.slot(full, record.array, init, of=record.name, rows=rows)
                      for s, (full, init) in slots.items()}
            rule(var, grad, rows, arrays, cfg, step)
        for table, ids, grad, slots in table_plan:
            table.apply(rule, ids, grad, slots, cfg, step)
        return {"t": step}

    async def save_checkpoint(self, req: SaveRequest) -> dict[str, Any]:
        """Write variables to a safetensors file under the checkpoint root."""
        return await self.checkpoints.save(req)

    async def restore_checkpoint(self, req: RestoreRequest) -> dict[str, Any]:
        """Read variables from checkpoint files; with ``stage``, hold them until committed."""
        return await self.checkpoints.restore(req)

    def commit_restore(self, req: StageRequest) -> dict[str, Any]:
        """Put a staged restore in place; the reply names this ps's incarnation, which the
        coordinator then knows holds restored state (a restart followed by a restore)."""
        return {**self.checkpoints.commit(req.stage), "incarnation": self.incarnation}

    def abort_restore(self, req: StageRequest) -> dict[str, Any]:
        return self.checkpoints.abort(req.stage)

    def call_function(self, req: CallRequest) -> dict[str, Any]:
        """Run a caller's function on arrays of this ps (``strategy.extended.update``).

        ``fn`` gets the variables as writable arrays, then ``args`` where every
        ``{"__pstrain_var__": name}`` is replaced by that variable's array. Runs on the
        serving loop, so it is atomic with respect to updates.
        """
        if not callable(req.fn):
            raise InvalidArgumentError(f"vars/call: 'fn' must be callable, got {type(req.fn).__name__}")
        records = [self.store.get(n) for n in req.vars]

        def resolve(obj: Any) -> Any:
            if isinstance(obj, dict) and set(obj) == {"__pstrain_var__"}:
                return self.store.get(obj["__pstrain_var__"]).writable()
            if type(obj) is tuple:
                return tuple(resolve(x) for x in obj)
            if type(obj) is list:
                return [resolve(x) for x in obj]
            return obj

        args = resolve(req.args)
        kwargs = {k: resolve(v) for k, v in req.kwargs.items()}
        arrays = [r.writable() for r in records]
        try:
            result = req.fn(*arrays, *(args if isinstance(args, (tuple, list)) else (args,)), **kwargs)
        except Exception as exc:  # the caller's code: say what it raised, not where on this host
            raise InvalidArgumentError(f"the function given to extended.update raised "
                                       f"{type(exc).__name__}: {exc}") from exc
        return {"result": result}


def _itemsize(dtype: str) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 0  # refused, with its name, when the variable is planned
