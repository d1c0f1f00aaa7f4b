"""W3's MLP as an equinox model: its arrays become ps variables, ``pstrain.jax`` differentiates.

``eqx.nn.MLP`` is a pytree: ``pstrain.jax.variables_from`` turns its arrays
into ps variables with the same tree structure, and the loss rebuilds the model
with ``eqx.combine``. Run it with ``python examples/mnist_mlp.py --framework
equinox``; same data and optimizer as the other W3 models (equinox's own
initial weights).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import pstrain
import pstrain.jax as pjax


def make_model():
    return eqx.nn.MLP(784, 10, width_size=256, depth=1, key=jax.random.PRNGKey(1))


async def build(strategy):
    arrays, static = eqx.partition(make_model(), eqx.is_array)
    async with strategy.scope():
        params = pjax.variables_from(arrays, name="mlp")
        opt = pstrain.optimizers.SGD(learning_rate=0.1)

    def loss_fn(p, x, y):
        logits = jax.vmap(eqx.combine(p, static))(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    async def step(it):
        x, y = next(it)
        loss, grads = await pjax.value_and_grad(loss_fn)(params, x, y.astype(np.int32))
        await opt.apply_gradients(grads)
        return loss

    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda v: isinstance(v, pstrain.Variable))

    async def predict_labels(x):
        values = await pstrain.read_variables(leaves)
        treedef = jax.tree_util.tree_structure(params, is_leaf=lambda v: isinstance(v, pstrain.Variable))
        model = eqx.combine(jax.tree_util.tree_unflatten(treedef, values), static)
        return np.asarray(jnp.argmax(jax.vmap(model)(jnp.asarray(x)), axis=1))

    return step, predict_labels


if __name__ == "__main__":  # run alone, this model trains in mnist_mlp.py's job
    import runpy
    import sys
    from pathlib import Path

    sys.argv[1:1] = ["--framework", "equinox"]
    runpy.run_path(str(Path(__file__).with_name("mnist_mlp.py")), run_name="__main__")
