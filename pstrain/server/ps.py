"""The parameter server: numpy variables served for reading and updating.

Every handler here is a plain function run on the server's loop with no
``await`` inside, which is what makes each update atomic per variable and a
batch all-or-nothing: a batch is validated entirely (names, dtypes, shapes,
row ids) before the first array changes.

Reads do not copy: a reply refers to the variable's own array, which is
*pinned* until the bytes have left. An in-place update of a pinned array
first copies it (copy-on-write), so a reader always sees one consistent
version and a writer never waits for a slow reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import initializers
from ..errors import AlreadyExistsError, InvalidArgumentError, NotFoundError
from .base import Pinned, ServerBase

logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]

UPDATE_OPS = ("assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub",
              "scatter_update")


class _Slot:
    """One variable: its array, and how many replies still refer to it."""

    __slots__ = ("name", "array", "trainable", "pins", "gen")

    def __init__(self, name: str, array: np.ndarray, trainable: bool) -> None:
        self.name = name
        self.array = array
        self.trainable = trainable
        self.pins = 0
        self.gen = 0

    def replace(self, array: np.ndarray) -> None:
        self.array = array
        self.pins = 0
        self.gen += 1

    def writable(self) -> np.ndarray:
        """The array, safe to change in place (copied first if shared)."""
        arr = self.array
        if self.pins or not arr.flags.writeable:
            arr = arr.copy()
            self.replace(arr)
        return arr

    def pin(self) -> Callable[[], None]:
        self.pins += 1
        gen = self.gen

        def release() -> None:
            if self.gen == gen and self.pins:
                self.pins -= 1

        return release


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
        self.vars: dict[str, _Slot] = {}
        self.route("vars/create", self.create)
        self.route("vars/read", self.read)
        self.route("vars/update", self.update)
        for op in UPDATE_OPS:
            self.route(f"vars/{op}", self._single_update(op))
        self.route("vars/sparse_read", self.sparse_read)
        self.route("vars/delete", self.delete)
        self.route("vars/list", self.list)
        self.route("opt/apply", self.apply_optimizer)
        self.route("ckpt/save", self.save_checkpoint)
        self.route("ckpt/restore", self.restore_checkpoint)
        self.route("vars/call", self.call_function, pickle=True)

    # -- helpers ---------------------------------------------------------------------------
    def _slot(self, name: Any) -> _Slot:
        slot = self.vars.get(name) if isinstance(name, str) else None
        if slot is None:
            raise NotFoundError(f"variable {name!r} not found on {self.task}")
        return slot

    def _value(self, slot: _Slot, value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype.kind not in "biufc":
            raise InvalidArgumentError(
                f"{what} of variable {slot.name!r}: values of dtype {arr.dtype} are not numbers")
        if arr.dtype != slot.array.dtype and not np.can_cast(arr.dtype, slot.array.dtype, "same_kind"):
            raise InvalidArgumentError(
                f"{what} of variable {slot.name!r}: dtype {arr.dtype} cannot be cast to the "
                f"variable's {slot.array.dtype}")
        if arr.shape != shape:
            raise InvalidArgumentError(
                f"{what} of variable {slot.name!r}: value has shape {arr.shape}, expected {shape}")
        return arr

    def _rows(self, slot: _Slot, indices: Any, what: str) -> np.ndarray:
        idx = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{what} of variable {slot.name!r}: row ids must be integers, got {idx.dtype}")
        if slot.array.ndim == 0:
            raise InvalidArgumentError(f"{what}: variable {slot.name!r} is a scalar and has no rows")
        n = slot.array.shape[0]
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = idx[(idx < 0) | (idx >= n)].reshape(-1)[0]
            raise InvalidArgumentError(
                f"{what} of variable {slot.name!r}: row id {int(bad)} out of range [0, {n})")
        return idx

    # -- create / delete / list ----------------------------------------------------------------
    def create(self, req: Any) -> dict[str, Any]:
        entries = _field(req, "vars", "vars/create")
        if not isinstance(entries, list):
            raise InvalidArgumentError("vars/create: 'vars' must be a list")
        built: list[_Slot] = []
        names: set[str] = set()
        for entry in entries:
            name = _field(entry, "name", "vars/create")
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(f"vars/create: variable names must be non-empty strings, got {name!r}")
            if name in self.vars or name in names:
                raise AlreadyExistsError(f"variable {name!r} already exists on {self.task}")
            names.add(name)
            built.append(_Slot(name, self._initial(entry), bool(entry.get("trainable", True))))
        for slot in built:
            self.vars[slot.name] = slot
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
        slots = [self._slot(n) for n in names]
        for slot in slots:
            self.vars.pop(slot.name, None)
        return {"deleted": len(slots)}

    def list(self, req: Any) -> dict[str, Any]:
        return {"variables": [
            {"name": s.name, "dtype": s.array.dtype.str, "shape": s.array.shape,
             "trainable": s.trainable, "nbytes": s.array.nbytes}
            for s in self.vars.values()]}

    # -- reads ---------------------------------------------------------------------------------
    def read(self, req: Any) -> Pinned:
        names = _field(req, "names", "vars/read")
        if not isinstance(names, list):
            raise InvalidArgumentError("vars/read: 'names' must be a list")
        slots = [self._slot(n) for n in names]
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
            slot = self._slot(_field(r, "name", "vars/sparse_read"))
            planned.append((slot, self._rows(slot, _field(r, "indices", "vars/sparse_read"),
                                             "sparse_read")))
        values = [slot.array[idx] for slot, idx in planned]
        return {"values": values}

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out["variables"] = len(self.vars)
        out["bytes"] = sum(s.array.nbytes for s in self.vars.values())
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
        slot = self._slot(_field(entry, "name", f"vars/update {op}"))
        shape = slot.array.shape
        dtype = slot.array.dtype
        if op in ("assign", "assign_add", "assign_sub"):
            value = self._value(slot, _field(entry, "value", op), shape, op)
            if op == "assign":
                def apply() -> None:
                    if value.dtype == dtype and value.flags.writeable and value.base is not None:
                        slot.replace(value)  # adopt the received buffer: no copy
                    else:
                        slot.replace(value.astype(dtype))
                return apply
            sign = 1 if op == "assign_add" else -1

            def apply() -> None:
                arr = slot.writable()
                if sign > 0:
                    np.add(arr, value, out=arr, casting="unsafe")
                else:
                    np.subtract(arr, value, out=arr, casting="unsafe")
            return apply
        if op in ("scatter_add", "scatter_sub", "scatter_update"):
            idx = self._rows(slot, _field(entry, "indices", op), op)
            if idx.ndim != 1:
                raise InvalidArgumentError(
                    f"{op} of variable {slot.name!r}: row ids must be 1-D, got shape {idx.shape}")
            values = self._value(slot, _field(entry, "values", op), (idx.shape[0],) + shape[1:], op)
            if op == "scatter_update":
                def apply() -> None:
                    slot.writable()[idx] = values
                return apply
            vals = values if op == "scatter_add" else -values

            def apply() -> None:
                np.add.at(slot.writable(), idx, vals.astype(dtype, copy=False))
            return apply
        raise InvalidArgumentError(f"vars/update: unknown op {op!r}; known: {list(UPDATE_OPS)}")

    # -- optimizers and functions run where the variables live -------------------------------
    def apply_optimizer(self, req: Any) -> dict[str, Any]:
        """Apply one optimizer step to the gradients of the variables on this ps.

        ``{"rule": {...}, "prefix": name, "grads": [[var, rows | None, values], ...],
        "iterations": var name | None, "t": step | None}``. Slots live here as variables
        ``<prefix>/<slot>/<var>`` and are created on first use. All or nothing.
        """
        from .rules import RULES, slot_specs

        cfg = _field(req, "rule", "opt/apply")
        prefix = _field(req, "prefix", "opt/apply")
        rule = RULES.get(cfg.get("kind")) if isinstance(cfg, dict) else None
        if rule is None:
            raise InvalidArgumentError(f"opt/apply: unknown rule {cfg!r}")
        specs = slot_specs(cfg)
        plan = []
        for entry in _field(req, "grads", "opt/apply"):
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise InvalidArgumentError("opt/apply: each gradient is [variable, rows or None, values]")
            name, rows, values = entry
            slot = self._slot(name)
            if slot.array.dtype.kind not in "fc":
                raise InvalidArgumentError(f"opt/apply: variable {name!r} of dtype "
                                           f"{slot.array.dtype} cannot be trained")
            if rows is None:
                grad = self._value(slot, values, slot.array.shape, "gradient")
            else:
                rows = self._rows(slot, rows, "sparse gradient")
                if rows.ndim != 1:
                    raise InvalidArgumentError(f"sparse gradient of {name!r}: rows must be 1-D")
                grad = self._value(slot, values, (rows.shape[0],) + slot.array.shape[1:],
                                   "sparse gradient")
                if not req.get("unique_rows"):
                    rows, inverse = np.unique(rows, return_inverse=True)
                    summed = np.zeros((rows.shape[0],) + grad.shape[1:], slot.array.dtype)
                    np.add.at(summed, inverse, grad)
                    grad = summed
            plan.append((slot, rows, grad))
        iterations = req.get("iterations")
        it_slot = self._slot(iterations) if iterations is not None else None
        t = req.get("t")
        if it_slot is not None:
            counter = it_slot.writable()
            counter += 1
            t = int(counter)
        t = int(t or 1)
        for slot, rows, grad in plan:
            var = slot.writable()
            slots = {s: self._slot_array(f"{prefix}/{s}/{slot.name}", slot.array, init)
                     for s, init in specs.items()}
            rule(var, grad.astype(var.dtype, copy=False), rows, slots, cfg, t)
        return {"t": t}

    async def save_checkpoint(self, req: Any) -> dict[str, Any]:
        """Write variables to a safetensors file: ``{"path", "tensors": {key: variable}}``."""
        from . import ps_files

        return await ps_files.save(self, req)

    async def restore_checkpoint(self, req: Any) -> dict[str, Any]:
        """Create or replace variables from checkpoint row ranges (see ``ps_files``)."""
        from . import ps_files

        return await ps_files.restore(self, req)

    def _slot_array(self, name: str, like: np.ndarray, init: float) -> np.ndarray:
        slot = self.vars.get(name)
        if slot is None:
            slot = self.vars[name] = _Slot(name, np.full(like.shape, init, like.dtype), False)
        return slot.writable()

    def call_function(self, req: Any) -> dict[str, Any]:
        """Run a caller's function on arrays of this ps (``strategy.extended.update``).

        ``{"fn": f, "vars": [names], "args": (...), "kwargs": {...}}``: ``f`` gets the
        variables as writable arrays, then ``args`` where every ``VarRef`` is replaced by
        its array. Runs on the serving loop, so it is atomic with respect to updates.
        """
        fn = _field(req, "fn", "vars/call")
        slots = [self._slot(n) for n in _field(req, "vars", "vars/call")]
        arrays = [s.writable() for s in slots]

        def resolve(obj: Any) -> Any:
            if isinstance(obj, dict) and set(obj) == {"__pstrain_var__"}:
                return self._slot(obj["__pstrain_var__"]).writable()
            if type(obj) is tuple:
                return tuple(resolve(x) for x in obj)
            if type(obj) is list:
                return [resolve(x) for x in obj]
            return obj

        args = resolve(req.get("args") or ())
        kwargs = {k: resolve(v) for k, v in (req.get("kwargs") or {}).items()}
        return {"result": fn(*arrays, *args, **kwargs)}
