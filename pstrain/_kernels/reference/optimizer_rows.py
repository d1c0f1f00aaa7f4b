"""The fused optimizer steps on rows of a variable, in numpy."""

from __future__ import annotations

import numpy as np

from .rows import positions_checked

__all__ = ["adagrad_rows", "rowwise_adagrad_rows", "sgd_rows"]


def sgd_rows(var: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float) -> None:
    keep = positions_checked("sgd_rows", var, rows)
    r, gr = rows[keep], g[keep]
    var[r] -= var.dtype.type(lr) * gr


def adagrad_rows(
    var: np.ndarray, acc: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> None:
    keep = positions_checked("adagrad_rows", var, rows)
    r, gr = rows[keep], g[keep]
    a = acc[r] + gr * gr
    acc[r] = a
    var[r] -= var.dtype.type(lr) * gr / np.sqrt(a + var.dtype.type(eps))


def rowwise_adagrad_rows(
    var: np.ndarray, acc: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> None:
    if acc.shape[0] < var.shape[0] or acc.shape[1] not in (1, var.shape[1]):
        raise ValueError("rowwise_adagrad_rows: acc is not one column, or var's width, per row")
    keep = positions_checked("rowwise_adagrad_rows", var, rows)
    r, gr = rows[keep], g[keep]
    t = var.dtype.type
    mean_sq = np.zeros(r.size, var.dtype)
    for j in range(var.shape[1]):  # in column order, as the compiled loop adds them
        mean_sq += gr[:, j] * gr[:, j]
    mean_sq /= t(var.shape[1])
    a = acc[r, 0] + mean_sq
    acc[r] = a[:, None]
    var[r] -= (t(lr) / (np.sqrt(a) + t(eps)))[:, None] * gr
