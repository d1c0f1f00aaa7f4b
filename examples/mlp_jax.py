"""W3's MLP as a JAX loss function: ``pstrain.jax`` computes every gradient.

Same data, initial weights and optimizer as ``mnist_mlp.py`` (run it with
``--framework jax``); only the model is written differently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from mnist_mlp import MLP, predict

import pstrain
import pstrain.jax as pjax


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


async def build(strategy):
    async with strategy.scope():
        model = MLP()
        opt = pstrain.optimizers.SGD(learning_rate=0.1)
    params = {"w1": model.w1, "b1": model.b1, "w2": model.w2, "b2": model.b2}

    async def step(it):
        x, y = next(it)
        loss, grads = await pjax.value_and_grad(loss_fn)(params, x, y.astype(np.int32))
        await opt.apply_gradients(grads)
        return loss

    async def predict_labels(x):
        return predict(await pstrain.read_variables(list(params.values())), x)

    return step, predict_labels


if __name__ == "__main__":  # run alone, this model trains in mnist_mlp.py's job
    import runpy
    import sys
    from pathlib import Path

    sys.argv[1:1] = ["--framework", "jax"]
    runpy.run_path(str(Path(__file__).with_name("mnist_mlp.py")), run_name="__main__")
