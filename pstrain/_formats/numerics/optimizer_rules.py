"""Optimizer update rules and their metadata, shared by the optimizers and the ps.

The client (``optimizers.py``) reads the metadata (which slots a rule needs,
their initial values); the ps runs the rules where the variable and its
slots live.

Each rule updates ``var`` and its slot arrays in place from a gradient, with
the formulas of Keras' optimizers. A sparse gradient (``rows`` given, unique,
duplicates already summed) updates only those rows of the variable *and* of
its slots; rows given as -1 are skipped (a table's ids that have no row). Rules are numpy,
and the sparse steps of SGD and Adagrad run as one fused compiled loop
(:mod:`pstrain._kernels`) with the same arithmetic; no I/O, no awaits, so an apply is atomic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._base.errors import InvalidArgumentError
from ..._kernels import KERNELS

__all__ = ["RULES", "slot_shape", "slot_specs"]


def _fusable(var: np.ndarray, g: np.ndarray, rows: np.ndarray, *numbers: Any) -> bool:
    """Whether a fused kernel takes this sparse step: float32/float64 rows of a C-contiguous
    variable, and hyper-parameters that are Python floats (numpy scalars would change the
    arithmetic numpy does, which the kernels reproduce)."""
    return (
        var.dtype in _FUSED_DTYPES
        and var.ndim >= 1
        and var.flags.c_contiguous
        and g.dtype == var.dtype
        and rows.dtype == np.int64
        and all(type(x) is float for x in numbers)
    )


_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: The one row of a dense step taken by a row kernel (the whole array as that row).
_ROW_0 = np.zeros(1, np.int64)
_ROW_0.setflags(write=False)


def _dense_fusable(var: np.ndarray, g: np.ndarray, slots: tuple[np.ndarray, ...], *numbers: Any) -> bool:
    """Whether a row kernel takes this dense step with the whole array as one row (no
    temporaries the size of the variable, the same bytes as numpy's rule): float32/float64,
    every array C-contiguous and of the variable's shape and dtype, Python float
    hyper-parameters."""
    return (
        var.dtype in _FUSED_DTYPES
        and var.size > 0
        and all(
            type(a) is np.ndarray and a.dtype == var.dtype and a.shape == var.shape and a.flags.c_contiguous
            for a in (var, g, *slots)
        )
        and all(type(x) is float for x in numbers)
    )


def _one_row(a: np.ndarray) -> np.ndarray:
    """A C-contiguous ``a`` as one row, a view."""
    return a.reshape(1, a.size)


def _rows2d(a: np.ndarray, n: int, like: np.ndarray) -> np.ndarray:
    """``a`` as ``n`` rows of as many numbers as a row of ``like`` has (a view if it can)."""
    return np.ascontiguousarray(a).reshape(n, math.prod(like.shape[1:]))


def _kept(rows: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows that exist (not -1) and their gradients."""
    keep = rows >= 0
    return (rows, g) if keep.all() else (rows[keep], g[keep])


def _sgd(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    lr, momentum = cfg["learning_rate"], cfg.get("momentum", 0.0)
    if not momentum:
        if rows is None and _dense_fusable(var, g, (), lr):
            KERNELS.sgd_rows(_one_row(var), _ROW_0, _one_row(g), lr)
        elif rows is None:
            var -= lr * g
        elif _fusable(var, g, rows, lr):
            KERNELS.sgd_rows(_rows2d(var, var.shape[0], var), rows, _rows2d(g, rows.size, var), lr)
        else:
            rows, g = _kept(rows, g)
            var[rows] -= lr * g
        return
    if rows is not None:
        rows, g = _kept(rows, g)
    m = slots["momentum"]
    if rows is None:
        m *= momentum
        m -= lr * g
        if cfg.get("nesterov"):
            var += momentum * m - lr * g
        else:
            var += m
    else:
        mr = momentum * m[rows] - lr * g
        m[rows] = mr
        var[rows] += (momentum * mr - lr * g) if cfg.get("nesterov") else mr


def _adagrad(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    lr, eps = cfg["learning_rate"], cfg.get("epsilon", 1e-7)
    acc = slots["accumulator"]
    if rows is None and _dense_fusable(var, g, (acc,), lr, eps):
        KERNELS.adagrad_rows(_one_row(var), _one_row(acc), _ROW_0, _one_row(g), lr, eps)
    elif rows is None:
        acc += g * g
        var -= lr * g / np.sqrt(acc + eps)
    elif _fusable(var, g, rows, lr, eps) and acc.dtype == var.dtype and acc.flags.c_contiguous:
        n = var.shape[0]
        KERNELS.adagrad_rows(
            _rows2d(var, n, var), _rows2d(acc, n, var), rows, _rows2d(g, rows.size, var), lr, eps
        )
    else:
        rows, g = _kept(rows, g)
        a = acc[rows] + g * g
        acc[rows] = a
        var[rows] -= lr * g / np.sqrt(a + eps)


def _rowwise_adagrad(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    """Row-wise Adagrad (TorchRec's default, fbgemm's ``EXACT_ROWWISE_ADAGRAD``): one
    accumulator per row, ``acc += mean(g²)`` over the row, ``var -= lr · g / (sqrt(acc) + ε)``.
    A variable's accumulator is one column (:func:`slot_shape`); a dynamic table's is as
    wide as its rows (every column holds the row's value), as its other slots are."""
    lr, eps = cfg["learning_rate"], cfg.get("epsilon", 1e-8)
    acc = slots["accumulator"]
    if (
        rows is not None
        and _fusable(var, g, rows, lr, eps)
        and acc.dtype == var.dtype
        and acc.flags.c_contiguous
        and var.ndim == 2
    ):
        n = var.shape[0]
        KERNELS.rowwise_adagrad_rows(var, acc.reshape(n, -1), rows, _rows2d(g, rows.size, var), lr, eps)
        return
    if rows is not None:
        rows, g = _kept(rows, g)
    t_ = var.dtype.type
    n = var.shape[0] if var.ndim else 1
    v2 = var.reshape(n, -1)
    a2 = acc.reshape(n, -1)
    g2 = np.asarray(g, var.dtype).reshape(-1, v2.shape[1])
    sel: Any = slice(None) if rows is None else rows
    mean_sq = np.zeros(g2.shape[0], var.dtype)
    for j in range(g2.shape[1]):  # column order, as the compiled loop adds them
        mean_sq += g2[:, j] * g2[:, j]
    mean_sq /= t_(g2.shape[1])
    a = a2[sel, 0] + mean_sq
    a2[sel] = a[:, None]
    v2[sel] -= (t_(lr) / (np.sqrt(a) + t_(eps)))[:, None] * g2


def _adam(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    lr, b1, b2 = cfg["learning_rate"], cfg.get("beta_1", 0.9), cfg.get("beta_2", 0.999)
    eps = cfg.get("epsilon", 1e-7)
    alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    m, v = slots["m"], slots["v"]
    v_hat = slots.get("v_hat")  # AMSGrad: the step divides by the largest v so far
    if rows is None:
        m += (g - m) * (1 - b1)
        v += (g * g - v) * (1 - b2)
        if v_hat is not None:
            np.maximum(v_hat, v, out=v_hat)
        var -= alpha * m / (np.sqrt(v if v_hat is None else v_hat) + eps)
    else:
        mr = m[rows]
        mr += (g - mr) * (1 - b1)
        vr = v[rows]
        vr += (g * g - vr) * (1 - b2)
        m[rows], v[rows] = mr, vr
        if v_hat is not None:
            vr = np.maximum(v_hat[rows], vr)
            v_hat[rows] = vr
        var[rows] -= alpha * mr / (np.sqrt(vr) + eps)


def _ftrl_update(
    w: np.ndarray, g: np.ndarray, accum: np.ndarray, linear: np.ndarray, cfg: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lr = cfg["learning_rate"]
    power = cfg.get("learning_rate_power", -0.5)
    l1 = cfg.get("l1_regularization_strength", 0.0)
    l2 = cfg.get("l2_regularization_strength", 0.0) + cfg.get("beta", 0.0) / (2.0 * lr)
    shrink = cfg.get("l2_shrinkage_regularization_strength", 0.0)
    grad = g + 2 * shrink * w
    new_accum = accum + g * g
    linear = linear + grad - (np.power(new_accum, -power) - np.power(accum, -power)) / lr * w
    quadratic = np.power(new_accum, -power) / lr + 2 * l2
    clipped = np.clip(linear, -l1, l1)
    return (clipped - linear) / quadratic, new_accum, linear


def _ftrl(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    accum, linear = slots["accumulator"], slots["linear"]
    if rows is None:
        w, a, lin = _ftrl_update(var, g, accum, linear, cfg)
        var[...], accum[...], linear[...] = w, a, lin
    else:
        w, a, lin = _ftrl_update(var[rows], g, accum[rows], linear[rows], cfg)
        var[rows], accum[rows], linear[rows] = w, a, lin


def _rmsprop(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    """Keras' RMSprop: ``lr · g / sqrt(rms + ε)``, epsilon inside the root with momentum or
    without (Keras 2's and 3's rule, and TF's ApplyRMSProp)."""
    lr, rho, eps = cfg["learning_rate"], cfg.get("rho", 0.9), cfg.get("epsilon", 1e-7)
    momentum, centered = cfg.get("momentum", 0.0), cfg.get("centered", False)
    sel: Any = ... if rows is None else rows  # ... also indexes a scalar
    rms = slots["rms"][sel] * rho + (1 - rho) * g * g
    slots["rms"][sel] = rms
    denom = rms
    if centered:
        mg = slots["mg"][sel] * rho + (1 - rho) * g
        slots["mg"][sel] = mg
        denom = rms - mg * mg
    increment = lr * g / np.sqrt(denom + eps)
    if momentum:
        mom = momentum * slots["momentum"][sel] + increment
        slots["momentum"][sel] = mom
        var[sel] -= mom
    else:
        var[sel] -= increment


def _adamw(
    var: np.ndarray,
    g: np.ndarray,
    rows: np.ndarray | None,
    slots: dict[str, np.ndarray],
    cfg: dict[str, Any],
    t: int,
) -> None:
    """Keras' AdamW: decoupled weight decay ``var -= lr * weight_decay * var`` first (only the
    rows of a sparse gradient), then Adam."""
    _decay(var, rows, cfg["learning_rate"] * cfg.get("weight_decay", 0.004))
    _adam(var, g, rows, slots, cfg, t)


def _decay(var: np.ndarray, rows: np.ndarray | None, decay: float) -> None:
    """``var -= var * decay``, on ``rows`` only when given (those that exist: not -1)."""
    if rows is None:
        var -= var * decay
    else:
        rows = rows[rows >= 0]
        var[rows] -= var[rows] * decay


Rule = Callable[
    [np.ndarray, np.ndarray, "np.ndarray | None", dict[str, np.ndarray], dict[str, Any], int], None
]


def _prepared(rule: Rule, *, skip_missing: bool, decay: bool = True) -> Rule:
    """``rule`` as the ps runs it: the sparse rows of -1 (and their gradients) left out
    first if ``skip_missing`` (the rules whose kernels do not skip them), then Keras'
    decoupled weight decay, ``var -= lr * weight_decay * var``, when ``weight_decay`` is set
    (Keras 3 takes it on every optimizer; AdamW's is its own rule)."""

    def run(
        var: np.ndarray,
        g: np.ndarray,
        rows: np.ndarray | None,
        slots: dict[str, np.ndarray],
        cfg: dict[str, Any],
        t: int,
    ) -> None:
        if skip_missing and rows is not None:
            rows, g = _kept(rows, g)
        if decay and cfg.get("weight_decay"):
            _decay(var, rows, cfg["learning_rate"] * cfg["weight_decay"])
        rule(var, g, rows, slots, cfg, t)

    run.__doc__ = rule.__doc__
    return run


RULES: dict[str, Rule] = {
    "sgd": _prepared(_sgd, skip_missing=False),
    "adagrad": _prepared(_adagrad, skip_missing=False),
    "rowwise_adagrad": _prepared(_rowwise_adagrad, skip_missing=False),
    "adam": _prepared(_adam, skip_missing=True),
    "adamw": _prepared(_adamw, skip_missing=True, decay=False),
    "ftrl": _prepared(_ftrl, skip_missing=True),
    "rmsprop": _prepared(_rmsprop, skip_missing=True),
}


def slot_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a rule's slot for a variable of ``shape``: the variable's, but row-wise
    Adagrad's accumulator, one number per row (``(rows, 1)``) of a variable of 2 or more
    dimensions."""
    if kind == "rowwise_adagrad" and len(shape) >= 2:
        return (shape[0], 1)
    return shape


def slot_specs(cfg: dict[str, Any]) -> dict[str, float]:
    """The slots a rule needs and the value each starts at."""
    kind = cfg.get("kind")
    if kind == "sgd":
        return {"momentum": 0.0} if cfg.get("momentum") else {}
    if kind == "adagrad":
        return {"accumulator": float(cfg.get("initial_accumulator_value", 0.1))}
    if kind == "rowwise_adagrad":
        return {"accumulator": float(cfg.get("initial_accumulator_value", 0.0))}
    if kind in ("adam", "adamw"):
        return {"m": 0.0, "v": 0.0, "v_hat": 0.0} if cfg.get("amsgrad") else {"m": 0.0, "v": 0.0}
    if kind == "rmsprop":
        specs = {"rms": 0.0}
        if cfg.get("momentum"):
            specs["momentum"] = 0.0
        if cfg.get("centered"):
            specs["mg"] = 0.0
        return specs
    if kind == "ftrl":
        return {"accumulator": float(cfg.get("initial_accumulator_value", 0.1)), "linear": 0.0}
    raise InvalidArgumentError(f"unknown optimizer rule {kind!r}; known: {sorted(RULES)}")
