"""The W4 model: a sparse CTR model with a 1,000,000 x 16 embedding table.

26 hashed categorical features share one table (sharded over the ps);
13 dense features join the 26 looked-up rows into a 429 -> 64 (ReLU) -> 1
(sigmoid) network trained with Adagrad on the ps. Only the rows a batch uses
travel, deduplicated, both ways. Data: the synthetic set of WORKLOADS.md (W4),
drawn in vectorised order (all ids, then dense features, then label draws).

It ships inside the package so that ``pstrain demo`` runs from an installed
wheel; ``examples/ctr_embedding.py`` trains it from the command line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ._formats.numerics.initializers import RandomUniform
from ._training.module import Module
from ._training.optimizers import Optimizer
from ._variables.arrays import IndexedSlices
from ._variables.batched import read_variables
from ._variables.segments import unique, unsorted_segment_sum
from ._variables.sharding import embedding_lookup
from ._variables.variables import Variable

__all__ = ["BATCH", "CTRModel", "evaluate", "forward", "log_loss", "make_step", "synthetic"]

ROWS, DIM, FEATURES, DENSE, BATCH = 1_000_000, 16, 26, 13, 512
HIDDEN = 64


def synthetic(n_train: int, n_test: int = 20_000, rows: int = ROWS) -> tuple[Any, Any]:
    """W4's data: hashed zipf ids, a linear teacher over a hidden per-id weight (``rows``:
    the table's rows, 25,000,000 for W7)."""
    rng = np.random.default_rng(0)
    t_emb = rng.standard_normal(rows)
    t_dense = rng.standard_normal(DENSE)
    n = n_train + n_test
    raw = rng.zipf(1.2, (n, FEATURES)).astype(np.uint64)
    f = np.arange(1, FEATURES + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = raw * np.uint64(0x9E3779B97F4A7C15) + f * np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(31)
    ids = (h % np.uint64(rows)).astype(np.int64)
    dense = rng.standard_normal((n, DENSE)).astype(np.float32)
    logit = t_emb[ids].sum(1) / np.sqrt(FEATURES) + dense @ t_dense / np.sqrt(DENSE)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    train = (ids[:n_train], dense[:n_train], labels[:n_train])
    test = (ids[n_train:], dense[n_train:], labels[n_train:])
    return train, test


class CTRModel(Module):
    """The embedding table and the two dense layers; create it in ``strategy.scope()``.

    ``rows`` x ``dim`` is the table's shape (W4: 1,000,000 x 16; W7: 25,000,000 x 32);
    ``table`` replaces it (a :class:`~pstrain.DynamicEmbedding` ``dim`` wide, for W6)."""

    def __init__(self, rows: int = ROWS, dim: int = DIM, table: Any = None, name: str = "ctr") -> None:
        super().__init__()
        self.dim = dim
        self.table = (
            table
            if table is not None
            else Variable(RandomUniform(-0.05, 0.05, seed=0), shape=(rows, dim), name=f"{name}/embedding")
        )
        rng = np.random.default_rng(1)
        width = FEATURES * dim + DENSE
        limit1, limit2 = np.sqrt(6 / (width + HIDDEN)), np.sqrt(6 / (HIDDEN + 1))
        self.w1 = Variable(
            rng.uniform(-limit1, limit1, (width, HIDDEN)).astype(np.float32), name=f"{name}/w1"
        )
        self.b1 = Variable(np.zeros(HIDDEN, np.float32), name=f"{name}/b1")
        self.w2 = Variable(rng.uniform(-limit2, limit2, (HIDDEN, 1)).astype(np.float32), name=f"{name}/w2")
        self.b2 = Variable(np.zeros(1, np.float32), name=f"{name}/b2")

    @property
    def dense(self) -> list[Any]:
        return [self.w1, self.b1, self.w2, self.b2]


def forward(
    rows: np.ndarray, inverse: np.ndarray, dense_x: np.ndarray, params: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    w1, b1, w2, b2 = params
    n = dense_x.shape[0]
    x = np.concatenate([rows[inverse].reshape(n, FEATURES * rows.shape[1]), dense_x], axis=1)
    h_pre = x @ w1 + b1
    h = np.maximum(h_pre, 0)
    z = (h @ w2 + b2)[:, 0]
    p = 1 / (1 + np.exp(-z))
    return x, h_pre, h, p


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def make_step(model: CTRModel, opt: Optimizer) -> Callable[[Any], Awaitable[float]]:
    """The training step to schedule: ``coordinator.schedule(step, args=(iterator,))``."""
    table, dense_vars, dim = model.table, model.dense, model.dim

    async def step(it: Any) -> float:
        ids, dense_x, y = next(it)
        rows_used, inverse = unique(ids.reshape(-1), sorted=True)
        rows, params = await asyncio.gather(embedding_lookup(table, rows_used), read_variables(dense_vars))
        x, h_pre, h, p = forward(rows, inverse, dense_x, params)
        w1, _, w2, _ = params
        n = len(y)
        dz = ((p - y) / n).astype(np.float32)[:, None]
        g_w2, g_b2 = h.T @ dz, dz.sum(0)
        dh = (dz @ w2.T) * (h_pre > 0)
        g_w1, g_b1 = x.T @ dh, dh.sum(0)
        d_emb = (dh @ w1[: FEATURES * dim].T).reshape(-1, dim)
        g_rows = unsorted_segment_sum(d_emb, inverse, rows_used.size)
        await opt.apply_gradients(
            [
                (IndexedSlices(g_rows, rows_used), table),
                (g_w1, model.w1),
                (g_b1, model.b1),
                (g_w2, model.w2),
                (g_b2, model.b2),
            ]
        )
        return log_loss(p, y)

    return step


async def evaluate(model: CTRModel, test: Any) -> float:
    """Held-out log loss of ``model`` on ``test`` (ids, dense features, labels)."""
    ids, dense_x, y = test
    rows_used, inverse = unique(ids.reshape(-1), sorted=True)
    table: Any = model.table
    if getattr(table, "dynamic_table", False):
        rows = await table.lookup(rows_used, training=False)  # evaluation admits nothing
    else:
        rows = await embedding_lookup(model.table, rows_used)
    params = await read_variables(model.dense)
    _, _, _, p = forward(rows, inverse, dense_x, params)
    return log_loss(p, y)
