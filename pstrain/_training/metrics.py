"""Metrics whose state lives on a ps, so every worker's updates add up.

Create them in ``strategy.scope()``; ``await m.update_state(...)`` from any
closure on any worker adds to the same totals (one request, atomic), ``await
m.result()`` reads them, ``await m.reset_state()`` zeroes them. A metric's
state variables are colocated on one ps.

>>> import asyncio
>>> m = Mean()                                  # outside a scope: a local metric
>>> asyncio.run(m.update_state([1.0, 3.0])); asyncio.run(m.result())
2.0
"""

from __future__ import annotations

import abc
import itertools
from typing import Any

import numpy as np

from .._base.checks import one_of
from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._variables.arrays import current_creator
from .._variables.batched import read_variables, update_variables
from .._variables.placement import Placement
from .._variables.variables import Variable

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "BinaryCrossentropy",
    "Mean",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "Precision",
    "Recall",
    "RootMeanSquaredError",
    "SparseCategoricalAccuracy",
    "Sum",
]

_counts: dict[str, itertools.count[int]] = {}


class Metric:
    """Base class: named state variables on one ps, and the three async methods."""

    def __init__(self, name: str | None = None) -> None:
        n = next(_counts.setdefault(type(self).__name__, itertools.count()))
        base = type(self).__name__.lower()
        self.name = name or (base if n == 0 else f"{base}_{n}")
        self._vars: dict[str, Variable] = {}

    _ps: int | None = None

    def _state(self, slot: str, value: Any) -> Variable:
        """Create a state variable: all of a metric's state lives whole on one ps."""
        placement = current_creator()
        if not isinstance(placement, Placement):
            var = Variable(value, name=f"{self.name}/{slot}", trainable=False)
        else:
            if self._ps is None:
                self._ps = placement.next_ps()
            with placement.colocated(self._ps):  # colocated: never partitioned
                var = Variable(value, name=f"{self.name}/{slot}", trainable=False)
        self._vars[slot] = var
        return var

    @property
    def variables(self) -> list[Variable]:
        """The metric's state variables (on the ps)."""
        return list(self._vars.values())

    async def _add(self, **deltas: Any) -> None:
        await update_variables([(self._vars[k], "assign_add", v) for k, v in deltas.items()])

    async def reset_state(self) -> None:
        """Set every state variable back to zero."""
        await update_variables([(v, "assign", np.zeros(v.shape, v.dtype)) for v in self._vars.values()])

    async def reset_states(self) -> None:
        """TF's older name for :meth:`reset_state` (its tutorial uses it)."""
        await self.reset_state()

    async def _values(self) -> dict[str, np.ndarray]:
        values = await read_variables(list(self._vars.values()))
        return dict(zip(self._vars, values))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _numbers(values: Any, what: str) -> np.ndarray:
    """``values`` as float64, or an error naming ``what`` (a metric's argument)."""
    try:
        return np.asarray(values, np.float64)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be numbers, got {np.asarray(values).dtype}") from None


def _weights(values: np.ndarray, sample_weight: Any) -> np.ndarray:
    """``sample_weight`` spread over ``values`` as Keras spreads it: aligned from the first
    axis (a weight per example covers each of its values; numpy would align the last axis
    and weigh columns instead), a trailing axis of 1 dropped."""
    if sample_weight is None:
        return np.ones(values.shape, np.float64)
    w = _numbers(sample_weight, "sample_weight")
    if w.ndim == values.ndim + 1 and w.shape[-1] == 1:
        w = w[..., 0]
    if w.ndim < values.ndim:
        w = w.reshape(w.shape + (1,) * (values.ndim - w.ndim))
    try:
        return np.broadcast_to(w, values.shape)
    except ValueError:
        raise InvalidArgumentError(
            f"sample_weight of shape {np.shape(sample_weight)} does not match the values' shape "
            f"{values.shape} (a weight per example, or per value)"
        ) from None


class _Averaged(Metric):
    """A weighted mean kept as ``total`` and ``count`` (Mean and the accuracies)."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.total = self._state("total", np.float64(0.0))
        self.count = self._state("count", np.float64(0.0))

    async def _accumulate(self, values: Any, sample_weight: Any) -> None:
        v = _numbers(values, f"{type(self).__name__}: the values")
        w = _weights(v, sample_weight)
        await self._add(total=np.float64((v * w).sum()), count=np.float64(w.sum()))

    async def result(self) -> float:
        s = await self._values()
        return float(s["total"] / s["count"]) if s["count"] else 0.0


class Mean(_Averaged):
    """The (weighted) mean of everything passed to ``update_state``."""

    async def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Add ``values`` (weighted by ``sample_weight``) to the running mean."""
        await self._accumulate(values, sample_weight)


class Sum(Metric):
    """The (weighted) sum of everything passed to ``update_state``."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.total = self._state("total", np.float64(0.0))

    async def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Add ``values`` (weighted by ``sample_weight``) to the sum."""
        v = _numbers(values, "Sum: the values")
        await self._add(total=np.float64((v * _weights(v, sample_weight)).sum()))

    async def result(self) -> float:
        """The sum so far."""
        return float((await self._values())["total"])


class Accuracy(_Averaged):
    """How often ``y_pred`` equals ``y_true``."""

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add how often ``y_pred`` equals ``y_true`` (weighted by ``sample_weight``) to the running mean."""
        y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
        if y_true.shape != y_pred.shape:
            raise InvalidArgumentError(f"Accuracy: y_true {y_true.shape} and y_pred {y_pred.shape} differ")
        await self._accumulate((y_true == y_pred).astype(np.float64), sample_weight)


class SparseCategoricalAccuracy(_Averaged):
    """How often ``argmax(y_pred)`` equals the integer label ``y_true``."""

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add how often the highest score of ``y_pred`` is at the label ``y_true`` to the running mean."""
        y_true = np.asarray(y_true).reshape(-1)
        y_pred = np.asarray(y_pred)
        pred = y_pred.reshape(-1, y_pred.shape[-1]).argmax(axis=-1)
        if pred.shape != y_true.shape:
            raise InvalidArgumentError(
                f"SparseCategoricalAccuracy: {y_true.size} labels for {pred.size} predictions"
            )
        await self._accumulate((pred == y_true).astype(np.float64), sample_weight)


def _pair_of(y_true: Any, y_pred: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels and predictions as float64 arrays of one shape, or an error naming ``what``."""
    t, p = _numbers(y_true, f"{what}: y_true"), _numbers(y_pred, f"{what}: y_pred")
    if t.shape != p.shape:
        raise InvalidArgumentError(f"{what}: y_true {t.shape} and y_pred {p.shape} differ")
    return t, p


class _PerExample(_Averaged, abc.ABC):
    """The weighted mean over examples of a loss averaged over each example's last axis
    (Keras' metrics of a loss). A batch of shape ``(n,)`` is ``n`` examples, as ``(n, 1)``:
    Keras takes it as one example of ``n`` values."""

    @abc.abstractmethod
    def _loss(self, y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
        """Each value's loss (``y_true`` and ``y_pred`` of one shape)."""

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add each example's loss (weighted by ``sample_weight``) to the running mean."""
        t, p = _pair_of(y_true, y_pred, type(self).__name__)
        per_value = self._loss(t, p)
        per_example = per_value.mean(axis=-1) if per_value.ndim >= 2 else per_value
        await self._accumulate(per_example, sample_weight)


class BinaryCrossentropy(_PerExample):
    """Log loss of probabilities (or, ``from_logits``, of logits) against labels in [0, 1],
    the labels smoothed towards 0.5 by ``label_smoothing``; probabilities are clipped to
    ``[1e-7, 1 - 1e-7]`` as Keras clips float32 ones."""

    def __init__(
        self, name: str | None = None, from_logits: bool = False, label_smoothing: float = 0.0
    ) -> None:
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
            raise InvalidArgumentError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise InvalidArgumentError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
        super().__init__(name)
        self.from_logits, self.label_smoothing = bool(from_logits), float(label_smoothing)

    def _loss(self, y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
        if self.label_smoothing:
            y_true = y_true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:  # TF's sigmoid_cross_entropy_with_logits, stable for any logit
            return np.maximum(y_pred, 0) - y_pred * y_true + np.log1p(np.exp(-np.abs(y_pred)))
        p = np.clip(y_pred, *_CLIP)
        return -(y_true * np.log(p) + (1 - y_true) * np.log(1 - p))


#: Keras' clip of probabilities, ``[1e-7, 1 - 1e-7]``, as float32 has those bounds (the
#: upper is 1 - 2**-23): the log loss of a prediction of exactly 0 or 1 is Keras' number.
_CLIP = (float(np.float32(1e-7)), float(np.float32(1 - 1e-7)))


class MeanSquaredError(_PerExample):
    """The mean of ``(y_true - y_pred) ** 2`` over each example, averaged over examples."""

    def _loss(self, y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
        return np.square(y_true - y_pred)


class MeanAbsoluteError(_PerExample):
    """The mean of ``|y_true - y_pred|`` over each example, averaged over examples."""

    def _loss(self, y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
        return np.abs(y_true - y_pred)


class RootMeanSquaredError(_Averaged):
    """The square root of the (weighted) mean of every squared error."""

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add the squared errors (weighted by ``sample_weight``) to the running mean."""
        t, p = _pair_of(y_true, y_pred, "RootMeanSquaredError")
        await self._accumulate(np.square(t - p), sample_weight)

    async def result(self) -> float:
        """The root of the mean squared error so far."""
        return float(np.sqrt(await super().result()))


class BinaryAccuracy(_Averaged):
    """How often ``y_pred > threshold`` equals the label (each value of a batch counted)."""

    def __init__(self, name: str | None = None, threshold: float = 0.5) -> None:
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not np.isfinite(threshold)
        ):
            raise InvalidArgumentError(f"threshold must be a finite number, got {threshold!r}")
        super().__init__(name)
        self.threshold = float(threshold)

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add how often the thresholded predictions equal the labels to the running mean."""
        t, p = _pair_of(y_true, y_pred, "BinaryAccuracy")
        hits = (t == (p > self.threshold)).astype(np.float64)
        await self._accumulate(hits, sample_weight)


#: Keras' threshold under every prediction (``top_k`` without thresholds: the top ``k`` count).
_BELOW_ALL = -1e10


def _top_k_only(p: np.ndarray, k: int) -> np.ndarray:
    """``p`` with all but each row's ``k`` largest values (last axis; of equal ones, the
    first) set below every threshold, as Keras filters them."""
    if p.ndim == 0:
        return p
    order = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    keep = np.zeros(p.shape, bool)
    np.put_along_axis(keep, order, True, axis=-1)
    return np.where(keep, p, _BELOW_ALL)


class _Confusion(Metric):
    """True and false positives (and negatives) at ``thresholds`` (a number or several;
    Keras' default 0.5): a prediction above a threshold is a positive, a label that is not 0
    a true one (Keras' rule). ``top_k``: only each row's ``k`` largest predictions (along the
    last axis) count, above every threshold unless ``thresholds`` is given; ``class_id``:
    only that column of ``(examples, classes)`` labels and predictions, after ``top_k``.
    Keras' arguments in Keras' order."""

    slots: tuple[str, ...] = ()

    def __init__(
        self,
        thresholds: float | list[float] | None = None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str | None = None,
        dtype: Any = None,
    ) -> None:
        what = type(self).__name__
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1
        ):
            raise InvalidArgumentError(f"{what}: top_k must be a positive integer or None, got {top_k!r}")
        if class_id is not None and (
            isinstance(class_id, bool) or not isinstance(class_id, (int, np.integer)) or class_id < 0
        ):
            raise InvalidArgumentError(f"{what}: class_id must be an integer of 0 or more, got {class_id!r}")
        given = (
            [0.5 if top_k is None else _BELOW_ALL]
            if thresholds is None
            else thresholds
            if isinstance(thresholds, (list, tuple))
            else [thresholds]
        )
        if thresholds is not None and (
            not given
            or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.0 <= x <= 1.0 for x in given
            )
        ):
            raise InvalidArgumentError(f"thresholds must be numbers in [0, 1], got {thresholds!r}")
        super().__init__(name)
        self.thresholds = np.array(given, np.float64)
        self.top_k = None if top_k is None else int(top_k)
        self.class_id = None if class_id is None else int(class_id)
        self._several = isinstance(thresholds, (list, tuple))
        for slot in self.slots:
            self._state(slot, np.zeros(len(given), np.float64))

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add the batch to the counts at each threshold."""
        what = type(self).__name__
        t, p = _pair_of(y_true, y_pred, what)
        w = _weights(t, sample_weight)
        if self.top_k is not None:
            p = _top_k_only(p, self.top_k)
        if self.class_id is not None:
            if p.ndim < 2 or self.class_id >= p.shape[-1]:
                raise InvalidArgumentError(
                    f"{what}(class_id={self.class_id}): labels and predictions must be "
                    f"(examples, classes) with that class among them, got shape {p.shape}"
                )
            t, p, w = t[..., self.class_id], p[..., self.class_id], w[..., self.class_id]
        w = w.reshape(-1, 1)
        positive = t.reshape(-1, 1) != 0
        above = p.reshape(-1, 1) > self.thresholds
        counts = {
            "true_positives": (w * (above & positive)).sum(axis=0),
            "false_positives": (w * (above & ~positive)).sum(axis=0),
            "false_negatives": (w * (~above & positive)).sum(axis=0),
        }
        await self._add(**{slot: counts[slot] for slot in self.slots})

    def _ratio(self, hits: np.ndarray, misses: np.ndarray) -> float | list[float]:
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.nan_to_num(hits / (hits + misses))  # 0 with nothing to count, as Keras
        return [float(x) for x in out] if self._several else float(out[0])


class Precision(_Confusion):
    """Of the predictions above the threshold, the share whose label is 1."""

    slots = ("true_positives", "false_positives")

    async def result(self) -> float | list[float]:
        """Precision so far (a list with several thresholds)."""
        s = await self._values()
        return self._ratio(s["true_positives"], s["false_positives"])


class Recall(_Confusion):
    """Of the labels 1, the share predicted above the threshold."""

    slots = ("true_positives", "false_negatives")

    async def result(self) -> float | list[float]:
        """Recall so far (a list with several thresholds)."""
        s = await self._values()
        return self._ratio(s["true_positives"], s["false_negatives"])


class AUC(Metric):
    """Area under the ROC curve (``curve="PR"``: the precision-recall curve; ``"PRGAIN"``:
    the precision-recall-gain one) from confusion counts at ``num_thresholds`` thresholds
    evenly over [0, 1], or at ``thresholds`` given, as Keras' ``AUC``: a Riemann sum whose
    heights ``summation_method`` chooses (``"interpolation"``, the trapezoids, or for PR
    Davis & Goadrich's interpolation; ``"minoring"``; ``"majoring"``). ``from_logits``:
    the predictions are logits (a sigmoid first). One label per example
    (``multi_label=True`` is refused)."""

    CURVES = ("ROC", "PR", "PRGAIN")
    SUMMATIONS = ("interpolation", "minoring", "majoring")

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = None,
        *,
        thresholds: list[float] | None = None,
        multi_label: bool = False,
        from_logits: bool = False,
    ) -> None:
        curve = one_of(curve, self.CURVES, "AUC: curve")
        summation_method = one_of(summation_method, self.SUMMATIONS, "AUC: summation_method")
        if multi_label:
            raise InvalidArgumentError("AUC: multi_label is not supported (one AUC per label: one AUC each)")
        eps = 1e-7
        if thresholds is not None:
            given = [float(t) for t in thresholds]
            if not given or any(not 0.0 <= t <= 1.0 for t in given):
                raise InvalidArgumentError(f"AUC: thresholds must be numbers in [0, 1], got {thresholds!r}")
            inner = sorted(given)
        else:
            if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds <= 1:
                raise InvalidArgumentError("num_thresholds must be > 1")
            inner = [(i + 1) * 1.0 / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        super().__init__(name)
        self.curve, self.summation_method = curve, summation_method
        self.from_logits = bool(from_logits)
        self.thresholds = np.array([0.0 - eps, *inner, 1.0 + eps])
        zeros = np.zeros(self.thresholds.size, np.float64)
        for slot in ("true_positives", "false_positives", "true_negatives", "false_negatives"):
            self._state(slot, zeros)

    async def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Add the predictions to the thresholds' true and false positive and negative counts."""
        y_true = np.asarray(y_true).reshape(-1).astype(bool)
        y_pred = _numbers(y_pred, "AUC: y_pred").reshape(-1)
        if y_true.shape != y_pred.shape:
            raise InvalidArgumentError(f"AUC: {y_true.size} labels for {y_pred.size} predictions")
        if self.from_logits:
            with np.errstate(over="ignore"):
                y_pred = 1.0 / (1.0 + np.exp(-y_pred))
        outside = ~((y_pred >= 0) & (y_pred <= 1))  # (NaN too, as TF's assertions)
        if outside.any():
            raise InvalidArgumentError(f"AUC: predictions must be in [0, 1], got {y_pred[outside][0]}")
        w = _weights(y_pred, sample_weight).reshape(-1)
        counts = {}
        for label, (above, below) in (
            (True, ("true_positives", "false_negatives")),
            (False, ("false_positives", "true_negatives")),
        ):
            mask = y_true == label
            preds, weights = y_pred[mask], w[mask]
            order = np.argsort(preds)
            cum = np.concatenate([[0.0], np.cumsum(weights[order])])
            n_below = cum[np.searchsorted(preds[order], self.thresholds, side="right")]
            counts[above] = cum[-1] - n_below  # pred > threshold
            counts[below] = n_below
        await self._add(**counts)

    async def result(self) -> float:
        """The area under the curve, from the counts so far."""
        s = await self._values()
        tp, fp, tn, fn = (
            s[k] for k in ("true_positives", "false_positives", "true_negatives", "false_negatives")
        )
        if self.curve == "PR" and self.summation_method == "interpolation":
            return _interpolated_pr_auc(tp, fp, fn)
        recall = _ratio(tp, tp + fn)
        if self.curve == "ROC":
            x, y = _ratio(fp, fp + tn), recall
        elif self.curve == "PR":
            x, y = recall, _ratio(tp, tp + fp)
        else:  # PRGAIN, Keras' fixes for no positives and for recall below the base rate
            scale = _ratio(tp + fn, tn + fp)
            x = np.maximum(np.where(tp == 0, 0.0, 1.0 - scale * _ratio(fn, tp)), 0.0)
            y = np.where(tp == 0, 1.0, 1.0 - scale * _ratio(fp, tp))
        if self.summation_method == "interpolation":
            heights = (y[:-1] + y[1:]) / 2
        elif self.summation_method == "minoring":
            heights = np.minimum(y[:-1], y[1:])
        else:
            heights = np.maximum(y[:-1], y[1:])
        return float(np.sum((x[:-1] - x[1:]) * heights))


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b``, 0 where ``b`` is 0 (Keras' ``divide_no_nan``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1.0), 0.0)


def _interpolated_pr_auc(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> float:
    """Keras' interpolation of the precision-recall curve between thresholds (Davis &
    Goadrich): precision taken to vary as true positives over predicted positives, each
    linear between two thresholds."""
    dtp = tp[:-1] - tp[1:]
    p = tp + fp
    dp = p[:-1] - p[1:]
    slope = _ratio(dtp, np.maximum(dp, 0))
    intercept = tp[1:] - slope * p[1:]
    both = (p[:-1] > 0) & (p[1:] > 0)
    p_ratio = np.where(both, _ratio(p[:-1], np.maximum(p[1:], 0)), 1.0)
    with np.errstate(divide="ignore"):
        logs = np.log(np.where(p_ratio > 0, p_ratio, 1.0))
    return float(np.sum(_ratio(slope * (dtp + intercept * logs), np.maximum(tp[1:] + fn[1:], 0))))


expose(globals(), "pstrain.metrics")
