"""W4: a sparse CTR model with a 1,000,000 x 16 embedding table sharded over the ps.

26 hashed categorical features share one table (two shards, FixedShardsPartitioner);
13 dense features join the 26 looked-up rows into a 429 -> 64 (ReLU) -> 1
(sigmoid) network trained with Adagrad on the ps. Only the rows a batch uses
travel, deduplicated, both ways. Data: the synthetic set of WORKLOADS.md (W4),
drawn in vectorised order (all ids, then dense features, then label draws).

    python examples/ctr_embedding.py [--steps 1000] [--workers 2] [--ps 2]
    pstrain launch --ps 2 --workers 2 -- python examples/ctr_embedding.py --steps 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np

import pstrain

ROWS, DIM, FEATURES, DENSE, BATCH = 1_000_000, 16, 26, 13, 512
HIDDEN = 64


def synthetic(n_train: int, n_test: int = 20_000):
    """W4's data: hashed zipf ids, a linear teacher over a hidden per-id weight."""
    rng = np.random.default_rng(0)
    t_emb = rng.standard_normal(ROWS)
    t_dense = rng.standard_normal(DENSE)
    n = n_train + n_test
    raw = rng.zipf(1.2, (n, FEATURES)).astype(np.uint64)
    f = np.arange(1, FEATURES + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = raw * np.uint64(0x9E3779B97F4A7C15) + f * np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(31)
    ids = (h % np.uint64(ROWS)).astype(np.int64)
    dense = rng.standard_normal((n, DENSE)).astype(np.float32)
    logit = t_emb[ids].sum(1) / np.sqrt(FEATURES) + dense @ t_dense / np.sqrt(DENSE)
    labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    train = (ids[:n_train], dense[:n_train], labels[:n_train])
    test = (ids[n_train:], dense[n_train:], labels[n_train:])
    return train, test


class CTRModel(pstrain.Module):
    def __init__(self):
        super().__init__()
        self.table = pstrain.Variable(pstrain.initializers.RandomUniform(-0.05, 0.05, seed=0),
                                      shape=(ROWS, DIM), name="ctr/embedding")
        rng = np.random.default_rng(1)
        width = FEATURES * DIM + DENSE
        limit1, limit2 = np.sqrt(6 / (width + HIDDEN)), np.sqrt(6 / (HIDDEN + 1))
        self.w1 = pstrain.Variable(rng.uniform(-limit1, limit1, (width, HIDDEN)).astype(np.float32), name="ctr/w1")
        self.b1 = pstrain.Variable(np.zeros(HIDDEN, np.float32), name="ctr/b1")
        self.w2 = pstrain.Variable(rng.uniform(-limit2, limit2, (HIDDEN, 1)).astype(np.float32), name="ctr/w2")
        self.b2 = pstrain.Variable(np.zeros(1, np.float32), name="ctr/b2")

    @property
    def dense(self):
        return [self.w1, self.b1, self.w2, self.b2]


def forward(rows, inverse, dense_x, params):
    w1, b1, w2, b2 = params
    n = dense_x.shape[0]
    x = np.concatenate([rows[inverse].reshape(n, FEATURES * DIM), dense_x], axis=1)
    h_pre = x @ w1 + b1
    h = np.maximum(h_pre, 0)
    z = (h @ w2 + b2)[:, 0]
    p = 1 / (1 + np.exp(-z))
    return x, h_pre, h, p


def log_loss(p, y):
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def make_step(model, opt):
    table, dense_vars = model.table, model.dense

    async def step(it):
        ids, dense_x, y = next(it)
        unique, inverse = np.unique(ids, return_inverse=True)
        rows, params = await asyncio.gather(pstrain.embedding_lookup(table, unique),
                                            pstrain.read_variables(dense_vars))
        x, h_pre, h, p = forward(rows, inverse.reshape(-1), dense_x, params)
        w1, _, w2, _ = params
        n = len(y)
        dz = ((p - y) / n).astype(np.float32)[:, None]
        g_w2, g_b2 = h.T @ dz, dz.sum(0)
        dh = (dz @ w2.T) * (h_pre > 0)
        g_w1, g_b1 = x.T @ dh, dh.sum(0)
        d_emb = (dh @ w1[:FEATURES * DIM].T).reshape(-1, DIM)
        g_rows = np.zeros((unique.size, DIM), np.float32)
        np.add.at(g_rows, inverse.reshape(-1), d_emb)
        await opt.apply_gradients([(pstrain.IndexedSlices(g_rows, unique), table),
                                   (g_w1, model.w1), (g_b1, model.b1), (g_w2, model.w2),
                                   (g_b2, model.b2)])
        return log_loss(p, y)

    return step


async def evaluate(model, test):
    ids, dense_x, y = test
    unique, inverse = np.unique(ids, return_inverse=True)
    rows = await pstrain.embedding_lookup(model.table, unique)
    params = await pstrain.read_variables(model.dense)
    _, _, _, p = forward(rows, inverse.reshape(-1), dense_x, params)
    return log_loss(p, y)


async def train(resolver, steps: int = 1000, quiet: bool = False, max_inflight: int = 1,
                cpu_clock=None):
    """Train; returns a dict of the figures (examples/s, losses, bytes per step)."""
    strategy = pstrain.ParameterServerStrategy(
        resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2))
    coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=max_inflight)
    async with strategy.scope():
        model = CTRModel()
        opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)
    n_train = steps * BATCH

    def dataset_fn():
        (ids, dense_x, y), _ = synthetic(n_train, 0)
        return pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y)).shuffle(50_000).repeat().batch(BATCH)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    step = make_step(model, opt)
    from pstrain import rpc
    from pstrain.progress import Progress

    peers = rpc.ChannelPool(strategy.cluster_spec, resolver.token)

    async def ps_bytes():
        total = 0
        for i in range(strategy.cluster_spec.num_tasks("ps")):
            stats = await peers.channel("ps", i).call("statistics", {})
            total += sum(r["bytes_in"] + r["bytes_out"] for r in stats["requests"].values())
        return total

    warm = max(1, steps // 10)
    with Progress(steps, "W4 steps", quiet=quiet) as bar:
        for _ in range(warm):
            coordinator.schedule(step, args=(iterator,))
        await coordinator.join()
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
    held_out = await evaluate(model, test)
    base = float(test[2].mean())
    base_loss = log_loss(np.full_like(test[2], base), test[2])
    result = {"examples_per_s": (steps - warm) * BATCH / elapsed, "held_out_log_loss": held_out,
              "base_rate_log_loss": base_loss, "bytes_per_step": bytes_per_step,
              "train_loss_last": float(np.mean([await rv for rv in rvs[-20:]])),
              "cpu_ms_per_step": cpu * 1e3 / (steps - warm)}
    if not quiet:
        print(f"W4: {steps} steps, {result['examples_per_s']:,.0f} examples/s, "
              f"{bytes_per_step / 1e6:.2f} MB on the wire per step, held-out log loss "
              f"{held_out:.4f} (base rate {base_loss:.4f})")
    await peers.close()
    await coordinator.close()
    return result


async def main(args):
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        return await train(pstrain.TFConfigClusterResolver(), args.steps, args.quiet)
    async with pstrain.LocalCluster(num_ps=args.ps, num_workers=args.workers) as cluster:
        return await train(cluster.resolver, args.steps, args.quiet)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--quiet", action="store_true")
    result = pstrain.run(main(parser.parse_args()))
    sys.exit(0 if result["held_out_log_loss"] < result["base_rate_log_loss"] else 1)
