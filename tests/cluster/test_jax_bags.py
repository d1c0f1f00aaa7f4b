"""pstrain.jax's pooled lookups: multi-hot bags pooled as TF pools them, gradients equal
JAX's own on the whole table, and bags of new lengths do not compile anew every batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pstrain
import pstrain.jax as pjax
from pstrain import JaggedTensor
from pstrain.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(120)


def loss_fn(params, y):
    h = jnp.concatenate([params["a"], params["b"]], axis=1) @ params["w"]
    return jnp.mean((h[:, 0] - y) ** 2)


def pooled(table, jt, combiner):
    """The pooled rows, written out per bag with JAX on the whole table."""
    out = []
    for b in range(len(jt)):
        lo, hi = int(jt.offsets[b]), int(jt.offsets[b + 1])
        w = jnp.ones(hi - lo) if jt.weights is None else jnp.asarray(jt.weights[lo:hi])
        rows = table[jt.values[lo:hi]] * w[:, None]
        total = {"sum": 1.0, "mean": w.sum(), "sqrtn": jnp.sqrt((w * w).sum())}[combiner]
        out.append(
            jnp.where(total > 0, rows.sum(0) / jnp.where(total > 0, total, 1), 0.0)
            if hi > lo
            else jnp.zeros(table.shape[1])
        )
    return jnp.stack(out)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
async def test_pooled_lookups_have_jaxs_own_gradients(cluster, combiner):
    strategy = pstrain.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2)
    )
    rng = np.random.default_rng(0)
    with strategy.scope():
        table = pstrain.Variable(rng.normal(0, 0.5, (30, 3)).astype(np.float32), name="t")
        w = pstrain.Variable(rng.normal(0, 0.5, (6, 1)).astype(np.float32), name="w")
        opt = pstrain.optimizers.SGD(1.0)
    a = JaggedTensor.from_lists([[1, 1, 29], [], [4], [7, 1]])
    b = JaggedTensor([3, 3, 0, 12, 5], [1, 2, 0, 2], weights=[0.5, 2.0, 1.0, 0.0, 3.0])
    y = rng.normal(size=4).astype(np.float32)
    t0, w0 = await table.numpy(), await w.numpy()
    grad_fn = pjax.value_and_grad(loss_fn)
    loss, grads = await grad_fn(
        {"a": pjax.pooled_lookup(table, a, combiner), "b": pjax.pooled_lookup(table, b, combiner), "w": w}, y
    )
    await opt.apply_gradients(grads)

    def full(t, w_):
        return loss_fn({"a": pooled(t, a, combiner), "b": pooled(t, b, combiner), "w": w_}, y)

    ref_loss, (g_t, g_w) = jax.value_and_grad(full, argnums=(0, 1))(jnp.asarray(t0), jnp.asarray(w0))
    assert abs(loss - float(ref_loss)) < 1e-5
    np.testing.assert_allclose(t0 - await table.numpy(), np.asarray(g_t), atol=1e-5)
    np.testing.assert_allclose(w0 - await w.numpy(), np.asarray(g_w), atol=1e-5)


async def test_bags_of_new_lengths_reuse_the_compiled_function(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    rng = np.random.default_rng(1)
    with strategy.scope():
        table = pstrain.Variable(rng.normal(0, 0.5, (500, 4)).astype(np.float32), name="t")

    def loss(params):
        return jnp.sum(params["bags"] ** 2)

    grad_fn = pjax.value_and_grad(loss)
    for _ in range(12):  # 16 bags of 1 to 5 ids each: 16 to 80 ids, new lengths every batch
        lengths = rng.integers(1, 6, 16)
        bags = JaggedTensor(rng.integers(0, 500, lengths.sum()), lengths)
        value, grads = await grad_fn({"bags": pjax.pooled_lookup(table, bags)})
        assert np.isfinite(value) and grads[0][0].indices.size == np.unique(bags.values).size
    # sizes are padded to powers of two: a handful of size classes, not one per batch
    assert grad_fn.compilations <= 4


async def test_sequences_padded_to_one_length_compile_once_and_match_jax(cluster):
    """A sequence feature in JAX: ``JaggedTensor.to_padded_dense`` cuts and pads each
    example's ids to one width (TorchRec's rule: the first ids kept), so the lookup of them
    compiles once for every batch; the masked loss's gradient is JAX's own on the whole
    table, the padding's row untouched."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    rng = np.random.default_rng(2)
    with strategy.scope():
        table = pstrain.Variable(rng.normal(0, 0.5, (50, 3)).astype(np.float32), name="t")
    jt = JaggedTensor([5, 6, 7, 8, 9, 1], [4, 0, 2])
    assert jt.to_padded_dense().tolist() == [[5, 6, 7, 8], [0, 0, 0, 0], [9, 1, 0, 0]]
    assert jt.to_padded_dense(2, padding_value=49).tolist() == [[5, 6], [49, 49], [9, 1]]
    assert jt.to_padded_dense(0).shape == (3, 0)

    def loss(params, mask):
        return jnp.sum((params["seq"] * mask[..., None]).sum(1) ** 2)

    grad_fn = pjax.value_and_grad(loss)
    for _ in range(6):  # batches of new lengths, one padded width
        lengths = rng.integers(0, 9, 8)
        seq = JaggedTensor(rng.integers(0, 49, lengths.sum()), lengths)
        ids = seq.to_padded_dense(5, padding_value=49)
        mask = (np.arange(5) < lengths[:, None]).astype(np.float32)
        t0 = await table.numpy()
        value, grads = await grad_fn({"seq": pjax.lookup(table, ids)}, mask)
        want, g_want = jax.value_and_grad(lambda t, i=ids, m=mask: loss({"seq": t[i]}, m))(jnp.asarray(t0))
        assert abs(value - float(want)) < 1e-4
        ((grad, _),) = grads
        dense = np.zeros_like(t0)
        np.add.at(dense, grad.indices, grad.values)
        np.testing.assert_allclose(dense, np.asarray(g_want), atol=1e-5)
        assert not dense[49].any()  # the padding's row gets nothing
    assert grad_fn.compilations == 1


async def test_a_batch_of_no_bags_and_one_of_empty_bags_pool_to_nothing_and_zeros(cluster):
    """A batch of no examples (the last of a dataset cut short) pools to no rows and one of
    empty bags to zeros, with empty gradients that change nothing (the first raised in
    JAX's gather, the way back of a sum into no segments)."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.Variable(np.ones((5, 3), np.float32), name="t")
        opt = pstrain.optimizers.SGD(1.0)
    grad_fn = pjax.value_and_grad(lambda p: jnp.sum(p["x"]) + p["x"].shape[0])
    for bags, expected in ((JaggedTensor.from_lists([]), 0.0), (JaggedTensor.from_lists([[], []]), 2.0)):
        for combiner in ("sum", "mean", "sqrtn"):
            loss, grads = await grad_fn({"x": pjax.pooled_lookup(table, bags, combiner)})
            assert loss == expected
            ((grad, var),) = grads
            assert var is table and grad.values.shape == (0, 3) and grad.indices.size == 0
            await opt.apply_gradients(grads)
    np.testing.assert_array_equal(await table.numpy(), np.ones((5, 3)))
