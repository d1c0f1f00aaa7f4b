"""W4's CTR model as a JAX loss function: ``pstrain.jax`` computes every gradient.

The same table, layers, initial weights, data and Adagrad as the hand-written
numpy model (``pstrain/ctr.py``); run it with
``python examples/ctr_embedding.py --framework jax``. The embedding rows are a
``pjax.lookup``: only the batch's unique rows are gathered, and their gradient
goes back as IndexedSlices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pstrain
import pstrain.jax as pjax
from pstrain.ctr import DIM, FEATURES, CTRModel, evaluate


def loss_fn(params, dense_x, y):
    n = dense_x.shape[0]
    x = jnp.concatenate([params["emb"].reshape(n, FEATURES * DIM), dense_x], axis=1)
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    z = (h @ params["w2"] + params["b2"])[:, 0]
    return jnp.mean(jnp.logaddexp(0.0, z) - y * z)  # log loss on the logit, stable


async def build(strategy):
    async with strategy.scope():
        model = CTRModel()
        opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)

    async def step(it):
        ids, dense_x, y = next(it)
        params = {
            "emb": pjax.lookup(model.table, ids),
            "w1": model.w1,
            "b1": model.b1,
            "w2": model.w2,
            "b2": model.b2,
        }
        loss, grads = await pjax.value_and_grad(loss_fn)(params, dense_x, y)
        await opt.apply_gradients(grads)
        return loss

    return step, lambda test: evaluate(model, test), opt


if __name__ == "__main__":  # run alone, this model trains in ctr_embedding.py's job
    import runpy
    import sys
    from pathlib import Path

    sys.argv[1:1] = ["--framework", "jax"]
    runpy.run_path(str(Path(__file__).with_name("ctr_embedding.py")), run_name="__main__")
