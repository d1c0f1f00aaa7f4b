"""Optimizers run on the ps and match Keras' formulas (independent numpy reference)."""

from __future__ import annotations

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain.partitioners import FixedShardsPartitioner

from .conftest import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(60)


class Reference:
    """Keras' update rules written out plainly; sparse rows update only their slots."""

    def __init__(self, kind, cfg, var):
        self.kind, self.cfg, self.var, self.t = kind, cfg, var.astype(np.float64), 0
        init = cfg.get("initial_accumulator_value", 0.1)
        self.s = {"m": np.zeros_like(self.var), "v": np.zeros_like(self.var),
                  "acc": np.full_like(self.var, init), "lin": np.zeros_like(self.var)}

    def step(self, g, rows=None):
        self.t += 1
        c, s = self.cfg, self.s
        sel = slice(None) if rows is None else rows
        if rows is not None:
            u, inv = np.unique(rows, return_inverse=True)
            summed = np.zeros((u.size,) + g.shape[1:])
            np.add.at(summed, inv, g)
            sel, g = u, summed
        w = self.var[sel]
        lr = c["learning_rate"]
        if self.kind == "sgd":
            mom = c.get("momentum", 0.0)
            if mom:
                m = mom * s["m"][sel] - lr * g
                s["m"][sel] = m
                w = w + (mom * m - lr * g if c.get("nesterov") else m)
            else:
                w = w - lr * g
        elif self.kind == "adagrad":
            acc = s["acc"][sel] + g * g
            s["acc"][sel] = acc
            w = w - lr * g / np.sqrt(acc + c.get("epsilon", 1e-7))
        elif self.kind == "adam":
            b1, b2, eps = c.get("beta_1", 0.9), c.get("beta_2", 0.999), c.get("epsilon", 1e-7)
            m = s["m"][sel] + (g - s["m"][sel]) * (1 - b1)
            v = s["v"][sel] + (g * g - s["v"][sel]) * (1 - b2)
            s["m"][sel], s["v"][sel] = m, v
            alpha = lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
            w = w - alpha * m / (np.sqrt(v) + eps)
        elif self.kind == "ftrl":
            p = c.get("learning_rate_power", -0.5)
            l1, l2 = c.get("l1_regularization_strength", 0.0), c.get("l2_regularization_strength", 0.0)
            acc, lin = s["acc"][sel], s["lin"][sel]
            new_acc = acc + g * g
            lin = lin + g - (new_acc ** -p - acc ** -p) / lr * w
            quad = new_acc ** -p / lr + 2 * l2
            w = (np.clip(lin, -l1, l1) - lin) / quad
            s["acc"][sel], s["lin"][sel] = new_acc, lin
        self.var[sel] = w


CASES = [
    ("sgd", pstrain.optimizers.SGD, {"learning_rate": 0.1}),
    ("sgd", pstrain.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9}),
    ("sgd", pstrain.optimizers.SGD, {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True}),
    ("adagrad", pstrain.optimizers.Adagrad, {"learning_rate": 0.05, "initial_accumulator_value": 0.1}),
    ("adam", pstrain.optimizers.Adam, {"learning_rate": 0.01}),
    ("ftrl", pstrain.optimizers.Ftrl, {"learning_rate": 0.1, "l1_regularization_strength": 0.01,
                                       "l2_regularization_strength": 0.02}),
]


@pytest.mark.parametrize("kind, cls, cfg", CASES, ids=lambda x: str(x) if isinstance(x, str) else "")
async def test_dense_and_sparse_steps_match_the_reference(ps_pair, kind, cls, cfg):
    rng = np.random.default_rng(0)
    spec = {"ps": [s.address for s in ps_pair], "worker": ["127.0.0.1:9"]}
    strategy = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=TOKEN),
                                               variable_partitioner=FixedShardsPartitioner(2))
    w0 = rng.standard_normal((6, 3))
    e0 = rng.standard_normal((9, 4))
    async with strategy.scope():
        w = pstrain.Variable(w0.copy(), name="w")          # float64, sharded in 2
        table = pstrain.Variable(e0.copy(), name="table")  # sharded in 2
        opt = cls(**cfg)
    ref_w, ref_t = Reference(kind, cfg, w0), Reference(kind, cfg, e0)
    for step in range(5):
        g = rng.standard_normal((6, 3))
        rows = rng.integers(0, 9, size=7)  # duplicates on purpose
        vals = rng.standard_normal((7, 4))
        it = await opt.apply_gradients([(g, w), (pstrain.IndexedSlices(vals, rows), table)])
        assert it == step + 1
        ref_w.step(g)
        ref_t.step(vals, rows)
    np.testing.assert_allclose(await w.numpy(), ref_w.var, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(await table.numpy(), ref_t.var, rtol=1e-6, atol=1e-12)
    assert await opt.iterations.numpy() == 5


async def test_slots_stay_on_the_ps_and_untouched_rows_do_not_move(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        table = pstrain.Variable(np.ones((1000, 8), np.float32), name="emb")
        opt = pstrain.optimizers.Adam(0.1)
    await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((2, 8)), [3, 3]), table)])
    value = await table.numpy()
    assert (value[3] < 1).all() and (np.delete(value, 3, axis=0) == 1).all()
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    names = {v["name"] for v in (await ch.call("vars/list", {}))["variables"]}
    assert {opt.slot_variable_name(table, "m"), opt.slot_variable_name(table, "v")} <= names
    stats = (await ch.call("statistics", {}))["requests"]["opt/apply"]
    assert stats["bytes_out"] < 1000  # nothing but a small acknowledgement comes back
    m = (await ch.call("vars/read", {"names": [opt.slot_variable_name(table, "m")]}))["values"][0]
    assert (m[3] != 0).all() and (np.delete(m, 3, axis=0) == 0).all()
    await ch.close()


async def test_apply_gradients_one_request_per_ps(ps_pair):
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        vs = [pstrain.Variable(np.zeros(4, np.float32), name=f"v{i}") for i in range(4)]
        opt = pstrain.optimizers.SGD(1.0)
    channels = [rpc.Channel(s.address, token=TOKEN, task=f"ps{i}") for i, s in enumerate(ps_pair)]
    await opt.apply_gradients([(np.ones(4), v) for v in vs])
    counts = [(await ch.call("statistics", {}))["requests"]["opt/apply"]["count"] for ch in channels]
    assert counts == [1, 1]
    assert [(await v.numpy()).tolist() for v in vs] == [[-1.0] * 4] * 4
    for ch in channels:
        await ch.close()


async def test_training_from_workers(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        w = pstrain.Variable(np.zeros(3), name="w")
        opt = pstrain.optimizers.SGD(0.5)
    target = np.array([1.0, -2.0, 3.0])

    async def step():
        value = await w.read_value()
        await opt.apply_gradients([(value - target, w)])  # gradient of 0.5 |w - target|^2

    for _ in range(60):
        coordinator.schedule(step)
    await coordinator.join()
    np.testing.assert_allclose(await w.numpy(), target, atol=1e-3)
    assert await opt.iterations.numpy() == 60
    await coordinator.close()
