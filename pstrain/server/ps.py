"""The parameter server: the handlers that read and update its variable store.

Every handler here is a plain function run on the server's loop with no
``await`` inside, which is what makes each update atomic per variable and a
batch all-or-nothing: a batch is validated entirely (names, dtypes, shapes,
row ids) before the first array changes. The variables themselves, with
their pins and copy-on-write, are the :class:`~pstrain.server.store.VariableStore`;
optimizer rules come from ``optimizer_rules.py``, checkpoint files from
``ps_checkpoint.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import initializers
from ..errors import AlreadyExistsError, InvalidArgumentError
from ..optimizer_rules import RULES, slot_specs
from . import ps_checkpoint
from .base import ServerBase
from .core import Pinned
from .store import VariableRecord, VariableStore

logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]

UPDATE_OPS = ("assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub",
              "scatter_update")


def _field(entry: Any, key: str, where: str) -> Any:
    if not isinstance(entry, dict) or key not in entry:
        raise InvalidArgumentError(f"{where}: missing field {key!r}")
    return entry[key]


class ParameterServer(ServerBase):
    """A ps task: ``Server(spec, "ps", k)`` builds one; tests may too.

    Operations (``POST /v1/<op>`` or the stream): ``vars/create``,
    ``vars/read``, ``vars/update`` (batched), ``vars/assign``,
    ``vars/assign_add``, ``vars/assign_sub``, ``vars/scatter_add``,
    ``vars/scatter_update``, ``vars/sparse_read``, ``vars/delete``,
    ``vars/list``, plus ``health`` and ``statistics``.
    """

    def __init__(self, index: int, **kwargs: Any) -> None:
        super().__init__("ps", index, **kwargs)
        self.store = VariableStore(self.task)
        self.route("vars/create", self.create)
        self.route("vars/read", self.read)
        self.route("vars/update", self.update)
        for op in UPDATE_OPS:
            self.route(f"vars/{op}", self._single_update(op))
        self.route("vars/sparse_read", self.sparse_read)
        self.route("vars/delete", self.delete)
        self.route("vars/list", self.list_variables)
        self.route("opt/apply", self.apply_optimizer)
        self.route("ckpt/save", self.save_checkpoint)
        self.route("ckpt/restore", self.restore_checkpoint)
        self.route("vars/call", self.call_function, pickle=True)

    # -- helpers ---------------------------------------------------------------------------
    def _value(self, record: VariableRecord, value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype.kind not in "biufc":
            raise InvalidArgumentError(
                f"{what} of variable {record.name!r}: values of dtype {arr.dtype} are not numbers")
        if arr.dtype != record.array.dtype and not np.can_cast(arr.dtype, record.array.dtype, "same_kind"):
            raise InvalidArgumentError(
                f"{what} of variable {record.name!r}: dtype {arr.dtype} cannot be cast to the "
                f"variable's {record.array.dtype}")
        if arr.shape != shape:
            raise InvalidArgumentError(
                f"{what} of variable {record.name!r}: value has shape {arr.shape}, expected {shape}")
        return arr

    def _rows(self, record: VariableRecord, indices: Any, what: str) -> np.ndarray:
        idx = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
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
    def create(self, req: Any) -> dict[str, Any]:
        entries = _field(req, "vars", "vars/create")
        if not isinstance(entries, list):
            raise InvalidArgumentError("vars/create: 'vars' must be a list")
        built: list[VariableRecord] = []
        names: set[str] = set()
        for entry in entries:
            name = _field(entry, "name", "vars/create")
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"vars/create: variable names must be non-empty strings, got {name!r}")
            if name in names or name in self.store:
                raise AlreadyExistsError(f"variable {name!r} already exists on {self.task}")
            names.add(name)
            built.append(VariableRecord(name, self._initial(entry), bool(entry.get("trainable", True))))
        self.store.add(built)
        return {"created": len(built)}

    def _initial(self, entry: dict[str, Any]) -> np.ndarray:
        name = entry["name"]
        try:
            dtype = np.dtype(_field(entry, "dtype", f"vars/create {name!r}"))
        except TypeError as exc:
            raise InvalidArgumentError(f"vars/create {name!r}: bad dtype: {exc}") from exc
        if dtype.kind not in "biufc":
            raise InvalidArgumentError(f"vars/create {name!r}: dtype {dtype} is not numeric")
        shape = tuple(_field(entry, "shape", f"vars/create {name!r}"))
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise InvalidArgumentError(f"vars/create {name!r}: bad shape {shape}")
        if "init" in entry:
            init = initializers.from_spec(entry["init"])
            return init(shape, dtype, offset=entry.get("offset"), full_shape=entry.get("full_shape"))
        value = _field(entry, "value", f"vars/create {name!r}")
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.shape != shape:
            raise InvalidArgumentError(
                f"vars/create {name!r}: value has shape {arr.shape}, declared {shape}")
        if arr.dtype.kind not in "biufc" or not np.can_cast(arr.dtype, dtype, "same_kind"):
            raise InvalidArgumentError(
                f"vars/create {name!r}: value of dtype {arr.dtype} cannot be cast to {dtype}")
        if arr.dtype == dtype and arr.flags.writeable:
            return arr
        return arr.astype(dtype)

    def delete(self, req: Any) -> dict[str, Any]:
        names = _field(req, "names", "vars/delete")
        return {"deleted": self.store.delete(list(names))}

    def list_variables(self, req: Any) -> dict[str, Any]:
        return {"variables": [
            {"name": s.name, "dtype": s.array.dtype.str, "shape": s.array.shape,
             "trainable": s.trainable, "nbytes": s.array.nbytes}
            for s in self.store]}

    # -- reads ---------------------------------------------------------------------------------
    def read(self, req: Any) -> Pinned:
        names = _field(req, "names", "vars/read")
        if not isinstance(names, list):
            raise InvalidArgumentError("vars/read: 'names' must be a list")
        slots = [self.store.get(n) for n in names]
        releases = [s.pin() for s in slots]

        def release() -> None:
            for r in releases:
                r()

        return Pinned({"values": [s.array for s in slots]}, release)

    def sparse_read(self, req: Any) -> dict[str, Any]:
        reads = req.get("reads") if isinstance(req, dict) and "reads" in req else [req]
        if not isinstance(reads, list):
            raise InvalidArgumentError("vars/sparse_read: 'reads' must be a list")
        planned = []
        for r in reads:
            record = self.store.get(_field(r, "name", "vars/sparse_read"))
            planned.append((record, self._rows(record, _field(r, "indices", "vars/sparse_read"),
                                             "sparse_read")))
        values = [record.array[idx] for record, idx in planned]
        return {"values": values}

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out["variables"] = len(self.store)
        out["bytes"] = self.store.nbytes
        return out

    # -- updates -------------------------------------------------------------------------------
    def _single_update(self, op: str) -> Callable[[Any], Any]:
        def handler(req: Any) -> dict[str, Any]:
            if isinstance(req, dict):
                req = {**req, "op": op}
            return self.update({"updates": [req]})

        handler.__name__ = f"update_{op}"
        return handler

    def update(self, req: Any) -> dict[str, Any]:
        """Apply a batch of updates, all or nothing."""
        entries = _field(req, "updates", "vars/update")
        if not isinstance(entries, list):
            raise InvalidArgumentError("vars/update: 'updates' must be a list")
        plan = [self._plan(entry) for entry in entries]  # raises before anything changes
        for apply in plan:
            apply()
        return {"updated": len(plan)}

    def _plan(self, entry: Any) -> Callable[[], None]:
        op = _field(entry, "op", "vars/update")
        record = self.store.get(_field(entry, "name", f"vars/update {op}"))
        shape = record.array.shape
        dtype = record.array.dtype
        if op in ("assign", "assign_add", "assign_sub"):
            value = self._value(record, _field(entry, "value", op), shape, op)
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
                    np.add(arr, value, out=arr, casting="unsafe")
                else:
                    np.subtract(arr, value, out=arr, casting="unsafe")
            return apply
        if op in ("scatter_add", "scatter_sub", "scatter_update"):
            idx = self._rows(record, _field(entry, "indices", op), op)
            if idx.ndim != 1:
                raise InvalidArgumentError(
                    f"{op} of variable {record.name!r}: row ids must be 1-D, got shape {idx.shape}")
            values = self._value(record, _field(entry, "values", op), (idx.shape[0],) + shape[1:], op)
            if op == "scatter_update":
                def apply() -> None:
                    record.writable()[idx] = values
                return apply
            vals = values if op == "scatter_add" else -values

            def apply() -> None:
                np.add.at(record.writable(), idx, vals.astype(dtype, copy=False))
            return apply
        raise InvalidArgumentError(f"vars/update: unknown op {op!r}; known: {list(UPDATE_OPS)}")

    # -- optimizers and functions run where the variables live -------------------------------
    def apply_optimizer(self, req: Any) -> dict[str, Any]:
        """Apply one optimizer step to the gradients of the variables on this ps.

        ``{"rule": {...}, "prefix": name, "grads": [[var, rows | None, values], ...],
        "iterations": var name | None, "t": step | None}``. Slots live here as variables
        ``<prefix>/<record>/<var>`` and are created on first use. All or nothing.
        """
        cfg = _field(req, "rule", "opt/apply")
        prefix = _field(req, "prefix", "opt/apply")
        rule = RULES.get(str(cfg.get("kind"))) if isinstance(cfg, dict) else None
        if rule is None:
            raise InvalidArgumentError(f"opt/apply: unknown rule {cfg!r}")
        specs = slot_specs(cfg)
        plan = []
        for entry in _field(req, "grads", "opt/apply"):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise InvalidArgumentError("opt/apply: each gradient is [variable, rows or None, values]")
            name, rows, values = entry
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
                if not req.get("unique_rows"):
                    rows, inverse = np.unique(rows, return_inverse=True)
                    summed = np.zeros((rows.shape[0],) + grad.shape[1:], record.array.dtype)
                    np.add.at(summed, inverse, grad)
                    grad = summed
            plan.append((record, rows, grad))
        iterations = req.get("iterations")
        it_slot = self.store.get(iterations) if iterations is not None else None
        t = req.get("t")
        if it_slot is not None:
            counter = it_slot.writable()
            counter += 1
            t = int(counter)
        t = int(t or 1)
        for record, rows, grad in plan:
            var = record.writable()
            slots = {s: self.store.slot(f"{prefix}/{s}/{record.name}", record.array, init)
                     for s, init in specs.items()}
            rule(var, grad.astype(var.dtype, copy=False), rows, slots, cfg, t)
        return {"t": t}

    async def save_checkpoint(self, req: Any) -> dict[str, Any]:
        """Write variables to a safetensors file: ``{"path", "tensors": {key: variable}}``."""
        return await ps_checkpoint.save(self.store, req)

    async def restore_checkpoint(self, req: Any) -> dict[str, Any]:
        """Create or replace variables from checkpoint row ranges (see ``ps_checkpoint``)."""
        return await ps_checkpoint.restore(self.store, req)

    def call_function(self, req: Any) -> dict[str, Any]:
        """Run a caller's function on arrays of this ps (``strategy.extended.update``).

        ``{"fn": f, "vars": [names], "args": (...), "kwargs": {...}}``: ``f`` gets the
        variables as writable arrays, then ``args`` where every ``VarRef`` is replaced by
        its array. Runs on the serving loop, so it is atomic with respect to updates.
        """
        fn = _field(req, "fn", "vars/call")
        slots = [self.store.get(n) for n in _field(req, "vars", "vars/call")]
        arrays = [s.writable() for s in slots]

        def resolve(obj: Any) -> Any:
            if isinstance(obj, dict) and set(obj) == {"__pstrain_var__"}:
                return self.store.get(obj["__pstrain_var__"]).writable()
            if type(obj) is tuple:
                return tuple(resolve(x) for x in obj)
            if type(obj) is list:
                return [resolve(x) for x in obj]
            return obj

        args = resolve(req.get("args") or ())
        kwargs = {k: resolve(v) for k, v in (req.get("kwargs") or {}).items()}
        return {"result": fn(*arrays, *args, **kwargs)}
