"""W3: a dense MLP (784 -> 256 ReLU -> 10) trained with plain SGD on the ps.

``--framework numpy`` (this file: a hand-written backward pass), ``jax``
(``mlp_jax.py``: a JAX loss, ``pstrain.jax``), ``equinox`` (``mlp_equinox.py``:
an equinox model) or ``torch`` (``mlp_torch.py``: an ``nn.Module``,
``pstrain.torch``): the same data and optimizer (and, but for equinox, initial
weights), so their accuracies compare.

The data is the synthetic, learnable set of ../shared/WORKLOADS.md (W3); with
``--digits`` it is scikit-learn's 8x8 digits, padded to 784 inputs, when
scikit-learn is installed. Each worker reads its own shuffled, repeated stream;
the coordinator schedules the steps and evaluates on held-out data at the end.

    python examples/mnist_mlp.py [--steps 2000] [--workers 2] [--ps 2] [--framework jax]
    pstrain launch --ps 2 --workers 2 -- python examples/mnist_mlp.py --steps 500
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import numpy as np

import pstrain

BATCH = 128


def synthetic(n_train: int = 60_000, n_test: int = 5_000):
    """W3's data: labels from a random linear teacher; inputs centred by the model."""
    rng = np.random.default_rng(0)
    t = rng.standard_normal((784, 10))
    x = rng.random((n_train, 784), np.float32)
    y = np.argmax(x @ t, 1)
    x_test = rng.random((n_test, 784), np.float32)
    y_test = np.argmax(x_test @ t, 1)
    return (x - 0.5, y), (x_test - 0.5, y_test)


def digits():
    """scikit-learn's 8x8 digits in a 784-wide input (first 1,500 train, rest test)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.zeros((len(d.data), 784), np.float32)
    x[:, :64] = d.data / 16.0 - 0.5
    y = d.target
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def glorot(rng, fan_in, fan_out):
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)


class MLP(pstrain.Module):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(1)
        self.w1 = pstrain.Variable(glorot(rng, 784, 256), name="mlp/w1")
        self.b1 = pstrain.Variable(np.zeros(256, np.float32), name="mlp/b1")
        self.w2 = pstrain.Variable(glorot(rng, 256, 10), name="mlp/w2")
        self.b2 = pstrain.Variable(np.zeros(10, np.float32), name="mlp/b2")


def forward_backward(params, x, y):
    """Loss and gradients of softmax cross-entropy (plain numpy)."""
    w1, b1, w2, b2 = params
    h_pre = x @ w1 + b1
    h = np.maximum(h_pre, 0)
    logits = h @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(y)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1
    d /= n
    g_w2 = h.T @ d
    g_b2 = d.sum(0)
    dh = (d @ w2.T) * (h_pre > 0)
    g_w1 = x.T @ dh
    g_b1 = dh.sum(0)
    return loss, (g_w1, g_b1, g_w2, g_b2)


def predict(params, x):
    w1, b1, w2, b2 = params
    return np.argmax(np.maximum(x @ w1 + b1, 0) @ w2 + b2, 1)


async def build(strategy):
    """The numpy model: (step to schedule, async predict(x) -> labels)."""
    async with strategy.scope():
        model = MLP()
        opt = pstrain.optimizers.SGD(learning_rate=0.1)
    variables = list(model.trainable_variables)

    async def step(it):
        x, y = next(it)
        params = await pstrain.read_variables(variables)
        loss, grads = forward_backward(params, x, y)
        await opt.apply_gradients(zip(grads, variables))
        return loss

    async def predict_labels(x):
        return predict(await pstrain.read_variables(variables), x)

    return step, predict_labels


#: The model of each framework: a module of examples/ with ``build(strategy)``.
FRAMEWORKS = {"numpy": "mnist_mlp", "jax": "mlp_jax", "equinox": "mlp_equinox", "torch": "mlp_torch"}


async def train(
    resolver,
    steps: int = 2000,
    use_digits: bool = False,
    quiet: bool = False,
    framework: str = "numpy",
    cpu_clock=None,
):
    """Train and return (examples per second, held-out accuracy); with ``cpu_clock``, also a
    dict of the CPU ms per step and the warm-up seconds (compilation included)."""
    strategy = pstrain.ParameterServerStrategy(resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    step, predict_labels = await importlib.import_module(FRAMEWORKS[framework]).build(strategy)
    loader = digits if use_digits else synthetic

    def dataset_fn():
        (x, y), _ = loader()
        return pstrain.data.Dataset.from_tensor_slices((x, y)).shuffle(10_000).repeat().batch(BATCH)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    from pstrain.progress import Progress

    warm = max(1, steps // 10)
    with Progress(steps, "W3 steps", quiet=quiet) as bar:
        losses = []
        t0 = time.perf_counter()
        for _ in range(warm):
            losses.append(coordinator.schedule(step, args=(iterator,)))
        await coordinator.join()
        warmup_s = time.perf_counter() - t0
        bar.update(warm)
        cpu_before = cpu_clock() if cpu_clock else 0.0
        t = time.perf_counter()
        rvs = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps - warm)]
        await bar.track(rvs, coordinator)
        elapsed = time.perf_counter() - t
        cpu_ms = (cpu_clock() - cpu_before) * 1e3 / (steps - warm) if cpu_clock else float("nan")
    _, (x_test, y_test) = loader()
    accuracy = float((await predict_labels(x_test) == y_test).mean())
    last = [await rv for rv in rvs[-20:]]
    rate = (steps - warm) * BATCH / elapsed
    if not quiet:
        print(
            f"W3 ({framework}): {steps} steps, {rate:,.0f} examples/s, last loss {np.mean(last):.3f}, "
            f"held-out accuracy {accuracy:.3f}"
        )
    await coordinator.close()
    if cpu_clock:
        return (
            rate,
            accuracy,
            {
                "cpu_ms_per_step": cpu_ms,
                "warmup_s": warmup_s,
                "warmup_steps": warm,
                "steady_ms_per_step": elapsed * 1e3 / (steps - warm),
            },
        )
    return rate, accuracy


async def main(args):
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        return await train(
            pstrain.TFConfigClusterResolver(), args.steps, args.digits, args.quiet, args.framework
        )
    async with pstrain.LocalCluster(num_ps=args.ps, num_workers=args.workers) as cluster:
        return await train(cluster.resolver, args.steps, args.digits, args.quiet, args.framework)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--digits", action="store_true", help="scikit-learn's digits instead")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="numpy")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # mlp_jax.py, mlp_torch.py
    rate, accuracy = pstrain.run(main(parser.parse_args()))
    sys.exit(0 if accuracy > 0.85 else 1)
