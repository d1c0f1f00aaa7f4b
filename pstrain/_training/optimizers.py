"""Optimizers whose update rules run on the parameter servers.

``await opt.apply_gradients(zip(grads, variables))`` sends each ps one request
carrying every gradient for the variables it holds; the ps applies the rule
(``optimizer_rules.py``, Keras' formulas) where the variable lives, so gradients
travel once and slots (accumulators, moments) never leave the ps. A gradient
may be a dense array or an :class:`~pstrain.IndexedSlices` (duplicate rows are
summed before sending; only those rows of the variable and its slots change).
Gradients for a :class:`~pstrain._variables.sharding.ShardedVariable` are split by part.

Create optimizers inside ``strategy.scope()``: ``iterations`` is then a ps
variable, incremented once per ``apply_gradients`` by whichever worker calls it.

::

    with strategy.scope():
        opt = pstrain.optimizers.Adagrad(0.05)
    await opt.apply_gradients(zip(grads, model.trainable_variables))
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.checks import number
from .._base.context import must_await
from .._base.errors import InvalidArgumentError, ProtocolError
from .._base.exports import expose
from .._base.tags import one_operation
from .._formats.messages.operations import (
    MORE_GRADS,
    MORE_STEPS,
    MORE_TABLES,
    ApplyGradients,
    OptimizerStep,
    PackedRows,
    most_alike,
)
from .._formats.messages.records import OptimizerRule
from .._formats.numerics import schedules
from .._formats.numerics.optimizer_rules import slot_specs
from .._formats.numerics.schedules import LearningRateSchedule
from .._kernels.batches import merge_duplicates
from .._variables.arrays import IndexedSlices, current_creator
from .._variables.batched import ensure_created, read_variables
from .._variables.dynamic import DynamicEmbedding
from .._variables.placement import Placement
from .._variables.routing import routed
from .._variables.sharding import ShardedVariable, compact_ids
from .._variables.variables import Variable
from .clipping import Clipping
from .step_order import updated

if TYPE_CHECKING:
    from .._transport.channels import Channel

logger = logging.getLogger("pstrain.optimizers")

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Ftrl",
    "Optimizer",
    "RMSprop",
    "RowWiseAdagrad",
    "apply_together",
    "schedules",
]

_counts: dict[str, itertools.count[int]] = {}


class Optimizer:
    """Base class: a named rule with hyper-parameters and an ``iterations`` counter.

    Every optimizer takes Keras' clipping, at most one of: ``clipnorm`` (each gradient's
    norm at most this), ``clipvalue`` (each value within ±this) or ``global_clipnorm`` (the
    norm of all the gradients of one ``apply_gradients``). The worker clips before it
    sends, as Keras clips what ``apply_gradients`` is given: a sparse gradient's values as
    they come, repeated rows and all. Keras ignores a clip of 0 or less; here it is refused.
    """

    kind = ""
    #: Does the rule need the global step (bias correction)? Then it is counted first, with
    #: the gradients of the counter's ps, and the other ps get theirs with it.
    needs_step = False

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        #: Keras' gradient clipping, done on the worker before the gradients leave.
        self.clipping = Clipping(clipnorm, clipvalue, global_clipnorm)
        if weight_decay is not None:  # (AdamW keeps its own, passing none here)
            number(weight_decay, "weight_decay (None: no decay)")
            self.weight_decay = float(weight_decay)
        if isinstance(learning_rate, LearningRateSchedule):
            self.learning_rate: float | LearningRateSchedule = learning_rate
            self.needs_step = True  # every ps evaluates the schedule at the same step
        elif (
            isinstance(learning_rate, bool)
            or not isinstance(learning_rate, (int, float))
            or not 0 < learning_rate < math.inf
        ):
            raise InvalidArgumentError(
                f"learning_rate must be a positive number or a LearningRateSchedule, got {learning_rate!r}"
            )
        else:
            self.learning_rate = float(learning_rate)
        n = next(_counts.setdefault(type(self).__name__, itertools.count()))
        self.name = name or (type(self).__name__ if n == 0 else f"{type(self).__name__}_{n}")
        placement = current_creator()
        self.iterations = _step_counter(placement, f"{self.name}/iterations", self.needs_step)
        #: A second step counter on another ps, counted in the same requests: the step
        #: survives the loss of either ps (a replacement gives the lost one the other's
        #: count, ``elastic/replace.py``).
        self.iterations_mirror = _mirror(self.iterations, f"{self.name}/iterations_mirror", placement)
        if self.iterations_mirror is not None:
            assert isinstance(placement, Placement)
            placement.counters.add(self)

    async def mirror_iterations(self) -> None:
        """Set the mirror to ``iterations`` (restored from a checkpoint older than mirrors)."""
        mirror = self.iterations_mirror
        if mirror is not None:
            step, mirrored = (int(x) for x in await read_variables([self.iterations, mirror]))
            if step != mirrored:
                await mirror.assign_add(np.int64(step - mirrored))

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config`` (the weight decay and the
        clipping among them when they are set)."""
        lr = self.learning_rate
        config: dict[str, Any] = {"learning_rate": lr.spec() if isinstance(lr, LearningRateSchedule) else lr}
        if getattr(self, "weight_decay", None) is not None:
            config["weight_decay"] = self.weight_decay
        return {**config, **self.clipping.config()}

    def _rule(self) -> dict[str, Any]:
        """The settings the ps applies (the clipping is done before the gradients leave)."""
        config = self.get_config()
        for done_here in self.clipping.config():
            del config[done_here]
        return {"kind": self.kind, **config}

    def slot_names(self) -> list[str]:
        """The slots this optimizer keeps per variable on the ps (e.g. ``accumulator``)."""
        return list(slot_specs(self._rule()))

    def slot_variable_name(self, var: Variable, slot: str) -> str:
        """The ps-side name of ``var``'s ``slot`` (for checkpoints and inspection)."""
        return f"{self.name}/{slot}/{var.key}"

    @must_await
    async def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> int:
        """Apply one step; returns the new ``iterations``. One request per ps, concurrently."""
        (step,) = await apply_together([(self, grads_and_vars)])
        return step

    def _items(self, grads_and_vars: Iterable[tuple[Any, Any]], k: int) -> tuple[list[Item], list[Variable]]:
        """This optimizer's part of a step: its items (``k``, its place in the step), each
        for the ps holding it, and the variable parts they update."""
        # ("grad", part, entry, k), ("table", (table, ps), entry, k); the counters' items
        # ("count" and "mirror") are added by apply_together
        items: list[Item] = []
        touched: list[Variable] = []
        pairs = [_pair(pair) for pair in grads_and_vars]
        missing = [getattr(var, "name", repr(var)) for grad, var in pairs if grad is None]
        if len(missing) == len(pairs):  # as Keras: a step without a gradient is a mistake
            raise InvalidArgumentError(f"No gradients provided for any variable: {missing}")
        if missing:
            logger.warning(
                "Gradients do not exist for variables %s when minimizing the loss; they are left as they are",
                missing,
            )
        pairs = [(grad, var) for grad, var in pairs if grad is not None]
        if self.clipping:
            pairs = list(zip(self.clipping.clip([grad for grad, _ in pairs]), (var for _, var in pairs)))
        for grad, var in pairs:
            if isinstance(var, DynamicEmbedding):
                if not isinstance(grad, IndexedSlices):
                    raise InvalidArgumentError(
                        f"the gradient of dynamic table {var.name!r} must be an IndexedSlices "
                        "(values, indices=ids)"
                    )
                for ps, ids, values in var.gradient_groups(grad.indices, grad.values):
                    items.append(("table", (var, ps), [var.key, ids, values], k))
                continue
            for part, rows, values in _split(grad, var):
                if part.ps_index is None:
                    raise InvalidArgumentError(
                        "apply_gradients: variables must be created in strategy.scope() (they live on the ps)"
                    )
                touched.append(part)
                items.append(("grad", part, [part.key, rows, values], k))
        return items, touched


#: One thing an optimizer step sends to a ps: ``(kind, where, entry, k)``, ``k`` the
#: optimizer's place in the step (:func:`apply_together`).
Item = tuple[str, Any, Any, int]


@must_await
async def apply_together(steps: Iterable[tuple[Optimizer, Iterable[tuple[Any, Any]]]]) -> list[int]:
    """Apply a step of several optimizers, each on its ``(gradient, variable)`` pairs, in one
    request per ps for all of them; returns each optimizer's new ``iterations``, in order.

    What TorchRec's ``CombinedOptimizer`` does for a fused table optimizer and a dense one,
    or a TF model with an optimizer for its wide part and another for its deep part::

        await pstrain.optimizers.apply_together(
            [(table_optimizer, ebc.gradients()), (dense_optimizer, remote.gradients())]
        )

    Each ps applies its part of every step in turn, all or nothing, as one
    ``apply_gradients`` would. An optimizer that needs the step (Adam's bias correction,
    a learning-rate schedule) has it counted first, in the request to the ps holding its
    ``iterations``; the other ps get theirs once it is known. Such optimizers make their
    counters on one ps, so several are counted in one request; two whose counters are on
    different ps (one made after the other's ps left the job) cost each of those ps a
    second request. An optimizer given twice is refused: give it all its pairs at once."""
    steps = list(steps)
    if not steps:
        raise InvalidArgumentError("apply_together: no (optimizer, pairs) given")
    for given in steps:
        if not (isinstance(given, (tuple, list)) and len(given) == 2 and isinstance(given[0], Optimizer)):
            raise InvalidArgumentError(
                "apply_together takes (optimizer, [(gradient, variable), ...]) pairs; got "
                f"{type(given).__name__} {str(given)[:60]}"
            )
    optimizers = [opt for opt, _ in steps]
    if len({id(opt) for opt in optimizers}) != len(optimizers):
        raise InvalidArgumentError(
            "apply_together: an optimizer is given twice; give all its (gradient, variable) pairs at once"
        )
    items: list[Item] = []
    touched: list[Variable] = []
    for k, (opt, pairs) in enumerate(steps):
        mine, parts = opt._items(pairs, k)  # noqa: SLF001 - this module's class
        items += mine
        touched += parts
    counters = [opt.iterations for opt in optimizers]
    mirrors = [opt.iterations_mirror for opt in optimizers]
    await ensure_created([*counters, *touched, *(mirror for mirror in mirrors if mirror is not None)])
    dynamic = {(id(where[0]), where[1]): where for kind, where, _, _ in items if kind == "table"}
    await asyncio.gather(*(table.shard_ready(ps) for table, ps in dynamic.values()))
    rules = [OptimizerRule(**opt._rule()) for opt in optimizers]  # noqa: SLF001 - this module's class
    pool = counters[0].channels()
    steps_now: list[int | None] = [None] * len(optimizers)  # each optimizer's step, once counted
    with one_operation():
        for k, mirror in enumerate(mirrors):
            items.append(("count", None, None, k))
            if mirror is not None:
                items.append(("mirror", None, None, k))

        def channel_of(item: Item) -> Channel:
            kind, where, _, k = item
            if kind == "grad":
                return where.channel()
            if kind == "table":
                return where[0].channel(where[1])
            counter = mirrors[k] if kind == "mirror" else counters[k]
            assert counter is not None
            return counter.channel()

        # bias correction (or a schedule) needs the step: it is counted first, in one
        # request with everything else the counter's ps takes; the other ps then get theirs
        # with the step (one request per ps still)
        homes = {counters[k].channel() for k, opt in enumerate(optimizers) if opt.needs_step}
        channels = [channel_of(item) for item in items]  # (routed() asks again, as it sends)
        first = [item for item, c in zip(items, channels) if c in homes]
        items = [item for item, c in zip(items, channels) if c not in homes]

        # the worker's next step may read once every request is written: the ps reads
        # a connection's requests in order (step_order.py)
        unsent = len(set(channels))  # (a send for each ps: first's, then the others')

        def sent() -> None:
            nonlocal unsent
            unsent -= 1
            if unsent == 0:
                updated()

        async def send(channel: Channel, group: list[Item]) -> list[tuple[int, int]]:
            by_optimizer: dict[int, list[Item]] = {}
            for item in group:
                by_optimizer.setdefault(item[3], []).append(item)
            requests = _requests(by_optimizer)
            counted = []
            for n, parts in enumerate(requests, 1):  # (one request, unless too many optimizers)
                head, *more = (_step(optimizers[k], rules[k], part, steps_now[k]) for k, part in parts)
                reply = await channel.request(
                    ApplyGradients(**head, more=[OptimizerStep(**step) for step in more] or None),
                    on_sent=sent if n == len(requests) else None,
                )
                applied = [reply.t, *(reply.more or ())]
                if len(applied) != len(parts):
                    raise ProtocolError(
                        f"malformed reply to opt/apply from {channel.task}: {len(applied)} steps "
                        f"for {len(parts)} optimizers"
                    )
                counted += [
                    (k, int(t))
                    for (k, part), t in zip(parts, applied)
                    if any(kind == "count" for kind, *_ in part)
                ]
            return counted

        deferred: list[Item] = []

        async def send_first(channel: Channel, group: list[Item]) -> list[tuple[int, int]]:
            counting = {item[3] for item in group if item[0] == "count"}
            waits = [  # an optimizer's items that need its step, counted on another ps
                item
                for item in group
                if optimizers[item[3]].needs_step and steps_now[item[3]] is None and item[3] not in counting
            ]
            deferred.extend(waits)  # sent with the others, once the steps are known
            waiting = {id(item) for item in waits}
            now = [item for item in group if id(item) not in waiting]
            return await send(channel, now) if now else []

        try:
            results = await routed(pool, first, channel_of, send_first, _resplit) if first else []
            for k, step in (pair for result in results for pair in result):
                steps_now[k] = step
            items = deferred + items
            results = await routed(pool, items, channel_of, send, _resplit) if items else []
            for k, step in (pair for result in results for pair in result):
                steps_now[k] = step
        finally:
            updated()  # this worker's next step may read (step_order.py)
    return [int(step or 0) for step in steps_now]


def _requests(by_optimizer: dict[int, list[Item]]) -> list[list[tuple[int, list[Item]]]]:
    """The optimizers' parts for one ps, as requests: one, the largest part its own step and
    the others in ``more``, unless more than ``MORE_STEPS`` others, or one past what a step
    in ``more`` may name, need requests of their own."""
    if len(by_optimizer) == 1:  # (one optimizer: its own step, whatever its size)
        return [list(by_optimizer.items())]
    parts = sorted(by_optimizer.items(), key=lambda kv: -len(kv[1]))
    requests: list[list[tuple[int, list[Item]]]] = []
    for k, part in parts:
        grads = sum(kind == "grad" for kind, *_ in part)
        tables = sum(kind == "table" for kind, *_ in part)
        fits = grads <= MORE_GRADS and tables <= MORE_TABLES
        if requests and fits and len(requests[-1]) <= MORE_STEPS:
            requests[-1].append((k, part))
        else:
            requests.append([(k, part)])
    return requests


def _step(opt: Optimizer, rule: OptimizerRule, part: list[Item], step: int | None) -> dict[str, Any]:
    """The fields of optimizer ``opt``'s step in a request, from its items ``part``."""
    kinds = {kind for kind, *_ in part}
    mirror = opt.iterations_mirror
    # grads and tables as lists, not tuples: a list packs flat (a tuple is an ext)
    grads, packed = _packed([entry for kind, _, entry, _ in part if kind == "grad"])
    return {
        "rule": rule,
        "prefix": opt.name,
        "unique_rows": True,
        "grads": grads,
        "packed": packed,
        "tables": [entry for kind, _, entry, _ in part if kind == "table"] or None,
        "iterations": opt.iterations.key if "count" in kinds else None,
        "t": step,
        "mirror": mirror.key if "mirror" in kinds and mirror is not None else None,
    }


def _packed(grads: list[list[Any]]) -> tuple[list[list[Any]], PackedRows | None]:
    """``grads`` with the most sparse gradients of one dtype and row shape (two or more)
    taken out as one :class:`PackedRows`: a collection's table parts on a ps travel as two
    arrays. Only when every variable is named once (packed gradients are applied after the
    others: the order of one variable's two gradients would change)."""
    sparse = [
        entry
        for entry in grads
        if entry[1] is not None
        and entry[1].ndim == 1
        and entry[2].ndim >= 1
        and entry[2].shape[0] == entry[1].shape[0]
    ]
    most = most_alike(sparse, lambda entry: (entry[2].dtype, entry[2].shape[1:]))
    if not most or len({entry[0] for entry in grads}) != len(grads):
        return grads, None
    chosen = {id(entry) for entry in most}
    return [entry for entry in grads if id(entry) not in chosen], PackedRows.of(most)


def _step_counter(placement: Any, name: str, needs_step: bool) -> Variable:
    """An optimizer's step counter. One that needs the step goes beside the first such
    optimizer's (``Placement.step_home``, while that ps is in the job, and unless the caller
    colocates it: ``colocate_vars_with``), so a step of several counts them in one request;
    any other goes where the next variable would."""

    def made() -> Variable:
        return Variable(np.int64(0), name=name, trainable=False)

    if not isinstance(placement, Placement) or not needs_step:
        return made()
    if placement.step_home not in placement.active:  # the first, or its ps left the job
        counter = made()
        placement.step_home = counter.ps_index
        return counter
    if placement.colocating is not None:
        return made()
    with placement.colocated(placement.step_home):
        return made()


def _mirror(iterations: Variable, name: str, placement: Any) -> Variable | None:
    """The mirror of step counter ``iterations``: on the next ps of the job (none with one
    ps, or outside a strategy)."""
    home = iterations.ps_index
    if not isinstance(placement, Placement) or home is None or len(placement.active) < 2:
        return None
    after = [ps for ps in placement.active if ps > home] or placement.active
    with placement.colocated(after[0]):
        return Variable(np.int64(0), name=name, trainable=False)


def _resplit(group: list[Item]) -> list[Item]:
    """A refused group's items again, a dynamic table's ids cut by the newer map (part of
    the table moved to another ps)."""
    out: list[Item] = []
    for kind, where, entry, k in group:
        if kind != "table":
            out.append((kind, where, entry, k))
            continue
        table, (key, ids, values) = where[0], entry
        out += [("table", (table, ps), [key, ids[pos], values[pos]], k) for ps, pos in table.route(ids)]
    return out


def _dedupe(rows: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if rows.ndim == 1 and rows.size and bool(np.all(rows[1:] > rows[:-1])):
        return rows, values  # already sorted and unique (e.g. from np.unique)
    return merge_duplicates(rows, values)


def _split(grad: Any, var: Any) -> list[tuple[Variable, np.ndarray | None, np.ndarray]]:
    """(part, rows or None, values) for each variable part the gradient touches."""
    if isinstance(var, ShardedVariable):
        parts = var.variables
        offsets = var.offsets
        if isinstance(grad, IndexedSlices):
            rows, values = _dedupe(np.asarray(grad.indices), np.asarray(grad.values, var.dtype))
            if rows.ndim != 1 or (rows.size and (rows[0] < 0 or rows[-1] >= var.shape[0])):
                var.route(rows)  # raises, naming the row out of range
            # ascending and unique: each part's rows are one run, sliced without a copy
            bounds = np.searchsorted(rows, offsets)
            return [
                (parts[p], compact_ids(rows[lo:hi] - offsets[p]), values[lo:hi])
                for p, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
                if hi > lo
            ]
        g = np.asarray(grad, var.dtype)
        if g.shape != var.shape:
            raise InvalidArgumentError(f"gradient of {var.name!r} has shape {g.shape}, expected {var.shape}")
        return [(parts[i], None, g[offsets[i] : offsets[i + 1]]) for i in range(len(parts))]
    if not isinstance(var, Variable):
        raise InvalidArgumentError(f"apply_gradients: {type(var).__name__} is not a variable")
    if isinstance(grad, IndexedSlices):
        rows, values = _dedupe(np.asarray(grad.indices), np.asarray(grad.values, var.dtype))
        return [(var, compact_ids(rows), values)]
    g = np.asarray(grad, var.dtype)
    if g.shape != var.shape:
        raise InvalidArgumentError(f"gradient of {var.name!r} has shape {g.shape}, expected {var.shape}")
    return [(var, None, g)]


class SGD(Optimizer):
    """Gradient descent, optionally with (Nesterov) momentum."""

    kind = "sgd"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        if not 0 <= momentum <= 1:
            raise InvalidArgumentError(f"momentum must be in [0, 1], got {momentum}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        super().__init__(
            learning_rate,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            weight_decay=weight_decay,
        )

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config``."""
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}


class Adagrad(Optimizer):
    """Adagrad: ``acc += g²; var -= lr · g / sqrt(acc + ε)``."""

    kind = "adagrad"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        number(initial_accumulator_value, "initial_accumulator_value")
        number(epsilon, "epsilon")
        self.initial_accumulator_value, self.epsilon = float(initial_accumulator_value), float(epsilon)
        super().__init__(
            learning_rate,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            weight_decay=weight_decay,
        )

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config``."""
        return {
            **super().get_config(),
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
        }


class RowWiseAdagrad(Adagrad):
    """Row-wise Adagrad, TorchRec's default for embedding tables (fbgemm's
    ``EXACT_ROWWISE_ADAGRAD``): a row's one accumulator grows by the mean of its squared
    gradient, ``acc += mean(g²)``; ``var -= lr · g / (sqrt(acc) + ε)``. A dense variable's
    rows are its first axis (a vector's elements are rows of one). A variable's accumulator
    is one column, ``(rows, 1)``: a 16-wide table's slot takes a 16th of Adagrad's. A
    dynamic table keeps it as wide as its rows, as its other slots."""

    kind = "rowwise_adagrad"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.01,
        initial_accumulator_value: float = 0.0,
        epsilon: float = 1e-8,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:  # Adagrad's settings, with fbgemm's defaults
        super().__init__(
            learning_rate,
            initial_accumulator_value,
            epsilon,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            weight_decay=weight_decay,
        )


class Adam(Optimizer):
    """Adam with Keras' bias correction (step = iterations after the increment);
    ``amsgrad``: each step divides by the largest second moment so far (AMSGrad, a slot
    ``v_hat`` more)."""

    kind = "adam"
    needs_step = True

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        if not isinstance(amsgrad, (bool, np.bool_)):  # (a name given where it stood before)
            raise InvalidArgumentError(
                f"amsgrad must be True or False, got {amsgrad!r} (give name= by keyword)"
            )
        self.amsgrad = bool(amsgrad)
        for beta, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0 <= value < 1:  # at 1 the bias correction divides by 0
                raise InvalidArgumentError(f"{beta} must be in [0, 1), got {value!r}")
        number(epsilon, "epsilon")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        super().__init__(
            learning_rate,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            weight_decay=weight_decay,
        )

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config``."""
        config = {
            **super().get_config(),
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
        }
        return {**config, "amsgrad": True} if self.amsgrad else config


class AdamW(Adam):
    """Adam with decoupled weight decay (Keras' ``AdamW``): each step first does
    ``var -= learning_rate * weight_decay * var``; for a sparse gradient, only on its rows."""

    kind = "adamw"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
    ) -> None:
        number(weight_decay, "weight_decay")
        self.weight_decay = float(weight_decay)
        super().__init__(
            learning_rate,
            beta_1,
            beta_2,
            epsilon,
            amsgrad,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
        )

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config``."""
        return {**super().get_config(), "weight_decay": self.weight_decay}


class RMSprop(Optimizer):
    """RMSprop as Keras: ``rms = rho·rms + (1-rho)·g²``; ``var -= lr·g / sqrt(rms + ε)``,
    or with ``momentum``, ``mom = momentum·mom + lr·g / sqrt(rms + ε)``; ``var -= mom``;
    ``centered`` subtracts the square of the mean gradient from ``rms``."""

    kind = "rmsprop"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        centered: bool = False,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        if not 0 <= rho <= 1:
            raise InvalidArgumentError(f"rho must be in [0, 1], got {rho}")
        if not 0 <= momentum <= 1:
            raise InvalidArgumentError(f"momentum must be in [0, 1], got {momentum}")
        self.rho, self.momentum, self.epsilon = float(rho), float(momentum), float(epsilon)
        self.centered = bool(centered)
        super().__init__(
            learning_rate,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            weight_decay=weight_decay,
        )

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config``."""
        return {
            **super().get_config(),
            "rho": self.rho,
            "momentum": self.momentum,
            "epsilon": self.epsilon,
            "centered": self.centered,
        }


class Ftrl(Optimizer):
    """FTRL-proximal, as Keras implements it."""

    kind = "ftrl"

    def __init__(
        self,
        learning_rate: float | LearningRateSchedule = 0.001,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        l2_shrinkage_regularization_strength: float = 0.0,
        beta: float = 0.0,
        name: str | None = None,
        *,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        weight_decay: float | None = None,
    ) -> None:
        if learning_rate_power > 0:
            raise InvalidArgumentError("learning_rate_power must be <= 0")
        for setting, value in (  # (not ``name``: the optimizer's own was lost to this loop)
            ("initial_accumulator_value", initial_accumulator_value),  # as TF
            ("l1_regularization_strength", l1_regularization_strength),
            ("l2_regularization_strength", l2_regularization_strength),
            ("l2_shrinkage_regularization_strength", l2_shrinkage_regularization_strength),
            ("beta", beta),
        ):
            number(value, setting)
        self.learning_rate_power = float(learning_rate_power)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.l1_regularization_strength = float(l1_regularization_strength)
        self.l2_regularization_strength = float(l2_regularization_strength)
        self.l2_shrinkage_regularization_strength = float(l2_shrinkage_regularization_strength)
        self.beta = float(beta)
        super().__init__(
            learning_rate,
            name,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            weight_decay=weight_decay,
        )

    def get_config(self) -> dict[str, Any]:
        """The optimizer's settings, as Keras' ``get_config``."""
        return {
            **super().get_config(),
            "learning_rate_power": self.learning_rate_power,
            "initial_accumulator_value": self.initial_accumulator_value,
            "l1_regularization_strength": self.l1_regularization_strength,
            "l2_regularization_strength": self.l2_regularization_strength,
            "l2_shrinkage_regularization_strength": self.l2_shrinkage_regularization_strength,
            "beta": self.beta,
        }


def _pair(pair: Any) -> tuple[Any, Any]:
    """One ``(gradient, variable)`` of ``apply_gradients``, or InvalidArgumentError."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise InvalidArgumentError(
            "apply_gradients takes (gradient, variable) pairs, as "
            f"zip(grads, variables) gives; got {type(pair).__name__} "
            f"{str(pair)[:60]}"
        )
    return pair[0], pair[1]


expose(globals(), "pstrain.optimizers")
