"""What runs where the variables live: an optimizer step (``opt/apply``) and a caller's
function (``vars/call``, ``strategy.extended.update``), both on the serving loop, so each
is atomic with respect to other updates."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from ..._base.errors import InvalidArgumentError
from ..._formats.messages.operations import ApplyGradients, CallVariables, OptimizerStep
from ..._formats.messages.records import CallReply, StepReply
from ..._formats.numerics.optimizer_rules import RULES, slot_shape, slot_specs
from ..._formats.numerics.schedules import from_spec
from ..._kernels.batches import merge_duplicates
from .store import VariableStore, checked_row_order, checked_value
from .tables.handlers import TableHandlers, ids_by_table

__all__ = ["apply_gradients", "call_function"]


def apply_gradients(store: VariableStore, tables: TableHandlers, req: ApplyGradients) -> StepReply:
    """Apply one optimizer step to the gradients of the variables on this ps, all or nothing;
    with ``more``, the steps of several optimizers, each after the one before.

    ``grads`` are ``[variable, rows | None, values]``. Slots live here as variables
    ``<prefix>/<slot>/<variable>`` and are created on first use. Everything (every
    gradient, ``iterations``, the slots to create, in every step) is checked before
    anything changes. A variable (or a table) given twice has each gradient applied in
    turn, in the one step, as Keras' ``apply_gradients`` does.
    """
    steps = req.steps()
    plans = [_Plan(store, step) for step in steps]
    new_slots = {full: nbytes for plan in plans for full, nbytes in plan.new_slots.items()}
    if new_slots:
        store.check_budget(  # (the request's table rows, staged in RAM, stay there)
            sum(new_slots.values()),
            f"opt/apply: optimizer slots {sorted(new_slots)}",
            keep=ids_by_table((name, ids) for name, ids, _ in req.table_gradients()),
        )
    for plan, step in zip(plans, steps):
        plan.tables = tables.plan(step.tables or (), step.prefix, plan.specs)
    # -- commit: nothing below can fail on the request's account
    done = [plan.commit(store, tables) for plan in plans]
    return StepReply(t=done[0], more=done[1:] or None)


class _Plan:
    """One optimizer's step of an ``opt/apply``, checked (nothing changed yet)."""

    def __init__(self, store: VariableStore, req: ApplyGradients | OptimizerStep) -> None:
        self.cfg = cfg = {k: v for k, v in msgspec.structs.asdict(req.rule).items() if v is not None}
        if not isinstance(req.rule.learning_rate, float):  # a schedule: checked whole, here
            cfg["learning_rate"] = msgspec.to_builtins(req.rule.learning_rate)
            self.schedule: Any = from_spec(cfg["learning_rate"])
        else:
            self.schedule = None
        self.rule = RULES[req.rule.kind]
        self.specs = specs = slot_specs(cfg)
        self.t = req.t
        self.variables: list[tuple[Any, Any, Any, dict[str, tuple[str, float, tuple[int, ...]]]]] = []
        for name, rows, values in req.grads:  # (a variable given twice is updated twice, as Keras does)
            record = store.get(name)
            if record.array.dtype.kind not in "fc":
                raise InvalidArgumentError(
                    f"opt/apply: variable {name!r} of dtype {record.array.dtype} cannot be trained"
                )
            if rows is None:
                grad = checked_value(record, values, record.array.shape, "gradient")
            else:
                # int32 on the wire (half the bytes); the fused kernels take them as int64
                rows, ascending = checked_row_order(record, rows, "sparse gradient")
                if rows.ndim != 1:
                    raise InvalidArgumentError(f"sparse gradient of {name!r}: rows must be 1-D")
                grad = checked_value(
                    record, values, (rows.shape[0],) + record.array.shape[1:], "sparse gradient"
                )
                if not (req.unique_rows and ascending):
                    rows, grad = merge_duplicates(rows, np.asarray(grad, record.array.dtype))
            slots = {}
            shape = slot_shape(req.rule.kind, record.array.shape)
            for slot_name, init in specs.items():
                full = f"{req.prefix}/{slot_name}/{record.name}"
                existing = store.find(full)
                if existing is not None and (
                    existing.array.shape != shape or existing.array.dtype != record.array.dtype
                ):
                    raise InvalidArgumentError(
                        f"opt/apply: slot {full!r} is {existing.array.shape} "
                        f"{existing.array.dtype}; {req.rule.kind} keeps it "
                        f"{shape} {record.array.dtype}"
                    )
                slots[slot_name] = (full, init, shape)
            self.variables.append((record, rows, grad, slots))
        #: The slots this step makes, with their bytes.
        self.new_slots = {
            full: math.prod(shape) * record.dtype.itemsize
            for record, _, _, slots in self.variables
            for full, _, shape in slots.values()
            if store.find(full) is None
        }
        self.tables: list[Any] = []  # (planned once the slots have room: TableHandlers.plan)
        self.it_record = store.get(req.iterations) if req.iterations is not None else None
        self.counters = [store.get(name) for name in (req.iterations, req.mirror) if name is not None]
        for record in self.counters:
            if record.array.shape != () or record.array.dtype.kind not in "iu":
                raise InvalidArgumentError(
                    f"opt/apply: {record.name!r} is not an integer scalar step counter"
                )

    def commit(self, store: VariableStore, tables: TableHandlers) -> int:
        """Count the step and apply it; returns the step applied. Cannot fail on the
        request's account."""
        t = self.t
        for record in self.counters:
            counter = record.writable()
            counter += 1
            if record is self.it_record or (self.it_record is None and t is None):  # a mirror says its count
                t = int(counter)
        step = int(t or 1)
        cfg = self.cfg
        if self.schedule is not None:  # Keras reads the rate at iterations before the update
            cfg["learning_rate"] = self.schedule(step - 1)
        for record, rows, grad, slots in self.variables:
            var = record.writable(rows)
            arrays = {
                s: store.slot(full, record.array, init, of=record.name, rows=rows, shape=shape)
                for s, (full, init, shape) in slots.items()
            }
            self.rule(var, grad, rows, arrays, cfg, step)
        tables.apply(self.tables, self.rule, cfg, step)
        return step


def call_function(store: VariableStore, req: CallVariables) -> CallReply:
    """Run a caller's function on arrays of this ps (``strategy.extended.update``).

    ``fn`` gets the variables as writable arrays, then ``args`` where every
    ``{"__pstrain_var__": name}`` is replaced by that variable's array. Runs on the
    serving loop, so it is atomic with respect to updates.
    """
    if not callable(req.fn):
        raise InvalidArgumentError(f"vars/call: 'fn' must be callable, got {type(req.fn).__name__}")
    records = [store.get(n) for n in req.vars]

    def resolve(obj: Any) -> Any:
        if isinstance(obj, dict) and set(obj) == {"__pstrain_var__"}:
            return store.get(obj["__pstrain_var__"]).writable()
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
        raise InvalidArgumentError(
            f"the function given to extended.update raised {type(exc).__name__}: {exc}"
        ) from exc
    return CallReply(result=result)
