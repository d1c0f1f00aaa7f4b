"""W4: a sparse CTR model with a 1,000,000 x 16 embedding table sharded over the ps.

26 hashed categorical features share one table (two shards, FixedShardsPartitioner);
13 dense features join the 26 looked-up rows into a 429 -> 64 (ReLU) -> 1
(sigmoid) network trained with Adagrad on the ps. Only the rows a batch uses
travel, deduplicated, both ways. The model (data, layers, hand-written
backward pass, step) is ``pstrain/ctr.py``, shipped in the package so that
``pstrain demo`` trains it from an installed wheel; this file trains it.
``--framework jax`` (``ctr_jax.py``) and ``--framework torch`` (``ctr_torch.py``)
train the same model, data and initial weights written in JAX and in PyTorch,
with no gradient written by hand.

    python examples/ctr_embedding.py [--steps 1000] [--workers 2] [--ps 2] [--framework jax]
    pstrain launch --ps 2 --workers 2 -- python examples/ctr_embedding.py --steps 300
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import numpy as np

import pstrain
from pstrain.ctr import BATCH, CTRModel, evaluate, log_loss, make_step, synthetic


async def build(strategy):
    """The hand-written numpy model: (step to schedule, async held-out log loss of a test set,
    the optimizer)."""
    async with strategy.scope():
        model = CTRModel()
        opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
    return make_step(model, opt), lambda test: evaluate(model, test), opt


#: The model of each framework: a module of examples/ with ``build(strategy)``.
FRAMEWORKS = {"numpy": "ctr_embedding", "jax": "ctr_jax", "torch": "ctr_torch"}


async def ps_wire_bytes(peers, num_ps: int) -> int:
    """Bytes in and out of every ps so far, over all its requests (what W4 and W6 count as
    the bytes on the wire)."""
    total = 0
    for i in range(num_ps):
        stats = await peers.channel("ps", i).statistics()
        total += sum(r["bytes_in"] + r["bytes_out"] for r in stats["requests"].values())
    return total


async def train(
    resolver,
    steps: int = 1000,
    quiet: bool = False,
    max_inflight: int = 1,
    cpu_clock=None,
    framework: str = "numpy",
):
    """Train; returns a dict of the figures (examples/s, losses, bytes per step)."""
    strategy = pstrain.ParameterServerStrategy(
        resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
    )
    coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=max_inflight)
    step, held_out_loss, _ = await importlib.import_module(FRAMEWORKS[framework]).build(strategy)
    n_train = steps * BATCH

    def dataset_fn():
        (ids, dense_x, y), _ = synthetic(n_train, 0)
        return (
            pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y)).shuffle(50_000).repeat().batch(BATCH)
        )

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    from pstrain import rpc
    from pstrain.progress import Progress

    peers = rpc.ChannelPool(strategy.cluster_spec, resolver.token)

    async def ps_bytes():
        return await ps_wire_bytes(peers, strategy.cluster_spec.num_tasks("ps"))

    warm = max(1, steps // 10)
    with Progress(steps, "W4 steps", quiet=quiet) as bar:
        t0 = time.perf_counter()
        for _ in range(warm):
            coordinator.schedule(step, args=(iterator,))
        await coordinator.join()
        warmup_s = time.perf_counter() - t0
        bar.update(warm)
        bytes_before = await ps_bytes()
        cpu_before = cpu_clock() if cpu_clock else 0.0
        t = time.perf_counter()
        rvs = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps - warm)]
        await bar.track(rvs, coordinator, postfix=lambda loss: {"loss": f"{loss:.3f}"})
        elapsed = time.perf_counter() - t
        cpu = (cpu_clock() - cpu_before) if cpu_clock else float("nan")
        bytes_per_step = (await ps_bytes() - bytes_before) / (steps - warm)
    _, test = synthetic(n_train)
    held_out = await held_out_loss(test)
    base = float(test[2].mean())
    base_loss = log_loss(np.full_like(test[2], base), test[2])
    result = {
        "examples_per_s": (steps - warm) * BATCH / elapsed,
        "held_out_log_loss": held_out,
        "base_rate_log_loss": base_loss,
        "bytes_per_step": bytes_per_step,
        "train_loss_last": float(np.mean([await rv for rv in rvs[-20:]])),
        "cpu_ms_per_step": cpu * 1e3 / (steps - warm),
        "warmup_s": warmup_s,
        "warmup_steps": warm,
        "steady_ms_per_step": elapsed * 1e3 / (steps - warm),
    }
    if not quiet:
        print(
            f"W4 ({framework}): {steps} steps, {result['examples_per_s']:,.0f} examples/s, "
            f"{bytes_per_step / 1e6:.2f} MB on the wire per step, held-out log loss "
            f"{held_out:.4f} (base rate {base_loss:.4f})"
        )
    await peers.close()
    await coordinator.close()
    return result


async def main(args):
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        return await train(
            pstrain.TFConfigClusterResolver(), args.steps, args.quiet, framework=args.framework
        )
    async with pstrain.LocalCluster(num_ps=args.ps, num_workers=args.workers) as cluster:
        return await train(cluster.resolver, args.steps, args.quiet, framework=args.framework)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="numpy")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ctr_jax.py, ctr_torch.py
    result = pstrain.run(main(parser.parse_args()))
    sys.exit(0 if result["held_out_log_loss"] < result["base_rate_log_loss"] else 1)
