"""pstrain.jax: a JAX loss over ps variables, with a sharded embedding table; gradients equal
JAX's own, only looked-up rows travel, and the gradient function compiles once per worker."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pstrain
import pstrain.jax as pjax
from pstrain.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(120)


def loss_fn(params, x, y):
    emb = params["emb"].mean(axis=1)  # (B, D)
    h = jnp.tanh(jnp.concatenate([emb, x], axis=1) @ params["w"] + params["b"])
    return jnp.mean((h[:, 0] - y) ** 2)


def make(cluster, rows=40, dim=4):
    strategy = pstrain.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2)
    )
    rng = np.random.default_rng(0)
    with strategy.scope():
        table = pstrain.Variable(rng.normal(0, 0.5, (rows, dim)).astype(np.float32), name="emb")
        w = pstrain.Variable(rng.normal(0, 0.5, (dim + 3, 1)).astype(np.float32), name="w")
        b = pstrain.Variable(np.zeros(1, np.float32), name="b")
    return strategy, table, w, b


async def test_gradients_applied_on_the_ps_equal_jaxs_own(cluster):
    strategy, table, w, b = make(cluster)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        opt = pstrain.optimizers.SGD(1.0)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 40, size=(8, 3))
    ids[0, :] = 7  # duplicates, also across examples
    ids[1, 0] = 7
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = rng.normal(size=8).astype(np.float32)
    before = [await v.numpy() for v in (table, w, b)]

    async def step(ids, x, y):
        grad_fn = pjax.value_and_grad(loss_fn)
        loss, grads = await grad_fn({"emb": pjax.lookup(table, ids), "w": w, "b": b}, x, y)
        await opt.apply_gradients(grads)
        return loss, [type(g).__name__ for g, _ in grads]

    loss, kinds = await coordinator.schedule(step, args=(ids, x, y))
    assert sorted(kinds) == ["IndexedSlices", "ndarray", "ndarray"]

    def full_loss(t, w_, b_):  # JAX's own gradient, on whole arrays
        return loss_fn({"emb": t[ids], "w": w_, "b": b_}, x, y)

    ref_loss, ref_grads = jax.value_and_grad(full_loss, argnums=(0, 1, 2))(*before)
    assert abs(loss - float(ref_loss)) < 1e-6
    after = [await v.numpy() for v in (table, w, b)]
    for a, b0, g in zip(after, before, ref_grads):
        np.testing.assert_allclose(b0 - a, np.asarray(g), atol=1e-5)  # SGD(1.0): the step is the gradient
    untouched = np.setdiff1d(np.arange(40), ids)
    np.testing.assert_array_equal(after[0][untouched], before[0][untouched])
    await coordinator.close()


async def test_only_looked_up_rows_travel_and_it_compiles_once(cluster):
    strategy, table, w, b = make(cluster, rows=200_000, dim=16)  # 12.8 MB of table
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        opt = pstrain.optimizers.Adagrad(0.1)
    await strategy.flush()
    rng = np.random.default_rng(2)

    async def step(ids, x, y):
        grad_fn = pjax.value_and_grad(loss_fn)
        loss, grads = await grad_fn({"emb": pjax.lookup(table, ids), "w": w, "b": b}, x, y)
        await opt.apply_gradients(grads)
        return loss, grad_fn.compilations

    def traffic():
        total = 0
        for server in cluster.ps:
            total += sum(s[1] + s[2] for s in server.stats.values())
        return total

    await coordinator.schedule(
        step,
        args=(
            rng.integers(0, 200_000, (64, 4)),
            rng.normal(size=(64, 3)).astype(np.float32),
            rng.normal(size=64).astype(np.float32),
        ),
    )
    start = traffic()
    results = []
    for k in range(6):  # batches with more and fewer duplicate ids: same compiled code
        ids = rng.integers(0, 200_000 if k % 2 else 50, (64, 4))
        results.append(
            coordinator.schedule(
                step,
                args=(
                    ids,
                    rng.normal(size=(64, 3)).astype(np.float32),
                    rng.normal(size=64).astype(np.float32),
                ),
            )
        )
    await coordinator.join()
    per_step = (traffic() - start) / 6
    # 256 ids x 16 floats out and back, plus the dense layer: a few tens of KB, not 12.8 MB
    assert per_step < 60_000, per_step
    assert {(await r)[1] for r in results} == {1}  # each worker traced (compiled) once
    await coordinator.close()


async def test_variables_from_an_equinox_model_train_with_no_hand_gradient(cluster):
    import equinox as eqx

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    model = eqx.nn.MLP(2, 1, width_size=8, depth=1, key=jax.random.PRNGKey(0))
    arrays, static = eqx.partition(model, eqx.is_array)
    with strategy.scope():
        params = pjax.variables_from(arrays, name="mlp")
        opt = pstrain.optimizers.Adam(0.05)
    names = sorted(
        v.name for v in jax.tree_util.tree_leaves(params, is_leaf=lambda v: isinstance(v, pstrain.Variable))
    )
    assert names[0].startswith("mlp/") and len(names) == 4

    def mse(p, x, y):
        net = eqx.combine(p, static)
        return jnp.mean((jax.vmap(net)(x)[:, 0] - y) ** 2)

    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 2)).astype(np.float32)
    y = (x[:, 0] - 2 * x[:, 1]).astype(np.float32)

    async def step(x, y):
        loss, grads = await pjax.value_and_grad(mse)(params, x, y)
        await opt.apply_gradients(grads)
        return loss

    losses = [await coordinator.schedule(step, args=(x, y)) for _ in range(60)]
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    await coordinator.close()


def test_bad_leaves_are_refused():
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="2-D"):
        pjax.lookup(pstrain.Variable(np.zeros(3)), [0])
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="integers"):
        pjax.lookup(pstrain.Variable(np.zeros((3, 2))), [0.5])
