"""TensorFlow's parameter-server tutorial, custom training loop, ported to pstrain.

The same structure as the tutorial: a sharded embedding table and a dense
layer built in ``with strategy.scope()``, RMSprop, an ``Accuracy`` metric, a
per-worker dataset made with ``strategy.distribute_datasets_from_function``,
``step_fn`` calling ``strategy.run`` then ``strategy.reduce``, epochs of
``schedule`` + ``join``. Gradients are written out (a logistic model over
averaged embeddings); the tutorial's Keras layers become arrays.

Fault tolerance as TF's tutorial recommends: a checkpoint per epoch, and a
restarted coordinator (same command, same running ps and workers) restores
the latest one and finishes the job.

Runs on its own (a LocalCluster of 2 ps and 2 workers), or against a running
cluster from ``TF_CONFIG`` / ``PSTRAIN_CONFIG`` (``pstrain launch -- python ...``).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import pstrain
from pstrain.checkpoint import Checkpoint, CheckpointManager
from pstrain.data import Dataset
from pstrain.partitioners import MinSizePartitioner

VOCAB, IDS_PER_EXAMPLE, DIM, BATCH = 1000, 4, 8, 64


def make_data(n: int = 4096, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Examples of IDS_PER_EXAMPLE ids; the label is whether most ids are "even"."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(n, IDS_PER_EXAMPLE))
    labels = ((ids % 2 == 0).sum(axis=1) >= IDS_PER_EXAMPLE // 2 + 1).astype(np.int64)
    return ids, labels


class Model(pstrain.Module):
    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(1)
        self.embedding = pstrain.Variable(
            rng.normal(0, 0.1, (VOCAB, DIM)).astype(np.float32), name="embedding"
        )
        self.dense_w = pstrain.Variable(rng.normal(0, 0.1, DIM).astype(np.float32), name="dense/kernel")
        self.dense_b = pstrain.Variable(np.float32(0.0), name="dense/bias")


def build(strategy: pstrain.ParameterServerStrategy) -> tuple[Model, object, object, object]:
    with strategy.scope():  # plain `with`, as the tutorial
        model = Model()
        optimizer = pstrain.optimizers.RMSprop(learning_rate=0.1)
        accuracy = pstrain.metrics.Accuracy()
        epoch = pstrain.Variable(np.int64(0), name="epoch", trainable=False)
    return model, optimizer, accuracy, epoch


async def train(
    resolver: pstrain.ClusterResolver, run_dir: str, epochs: int, steps_per_epoch: int, quiet: bool = False
) -> float:
    num_ps = resolver.cluster_spec().num_tasks("ps")
    strategy = pstrain.ParameterServerStrategy(
        resolver, variable_partitioner=MinSizePartitioner(min_shard_bytes=4 << 10, max_shards=num_ps)
    )
    coordinator = pstrain.ClusterCoordinator(strategy)
    model, optimizer, accuracy, epoch = build(strategy)
    manager = CheckpointManager(
        Checkpoint(model=model, optimizer=optimizer, epoch=epoch), run_dir, max_to_keep=2
    )
    restored = await manager.restore_or_initialize()
    start = int(await epoch.numpy())
    if restored and not quiet:
        print(f"restored {os.path.basename(restored)}: continuing at epoch {start}", flush=True)
    features, labels_all = make_data()

    def dataset_fn(input_context: pstrain.InputContext) -> Dataset:
        batch = input_context.get_per_replica_batch_size(BATCH)
        return Dataset.from_tensor_slices((features, labels_all)).shuffle(1024).batch(batch).repeat()

    def per_worker_dataset_fn() -> pstrain.DistributedDataset:
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    async def step_fn(iterator):
        async def replica_fn(ids, labels):
            emb = await pstrain.embedding_lookup(model.embedding, ids)  # (B, k, D)
            w, b = await pstrain.read_variables([model.dense_w, model.dense_b])
            x = emb.mean(axis=1)
            pred = 1.0 / (1.0 + np.exp(-(x @ w + b)))
            p = np.clip(pred, 1e-7, 1 - 1e-7)
            loss = float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
            dlogit = ((pred - labels) / len(labels)).astype(np.float32)
            d_emb = np.repeat(
                (dlogit[:, None] * w[None, :] / IDS_PER_EXAMPLE)[:, None, :], IDS_PER_EXAMPLE, axis=1
            ).reshape(-1, DIM)
            await optimizer.apply_gradients(
                [
                    (pstrain.IndexedSlices(d_emb, ids.reshape(-1)), model.embedding),
                    (x.T @ dlogit, model.dense_w),
                    (np.float32(dlogit.sum()), model.dense_b),
                ]
            )
            await accuracy.update_state(labels, (pred > 0.5).astype(np.int64))
            return loss

        ids, labels = next(iterator)
        losses = await strategy.run(replica_fn, args=(ids, labels))
        return strategy.reduce(pstrain.ReduceOp.SUM, losses, axis=None)

    for i in range(start, epochs):
        await accuracy.reset_states()
        for _ in range(steps_per_epoch):
            coordinator.schedule(step_fn, args=(per_worker_iterator,))
        await coordinator.join()
        await epoch.assign(i + 1)
        path = await manager.save()
        if not quiet:
            print(
                f"Finished epoch {i}, accuracy is {await accuracy.result():.6f}; "
                f"saved {os.path.basename(path)}",
                flush=True,
            )
    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    final = float(await loss)
    if not quiet:
        print(f"Final loss is {final:.6f}; iterations {await optimizer.iterations.numpy()}", flush=True)
    await coordinator.close()
    return final


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=5)
    parser.add_argument("--run-dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="pstrain-tutorial-")
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        await train(pstrain.TFConfigClusterResolver(), run_dir, args.epochs, args.steps_per_epoch)
    else:
        async with pstrain.LocalCluster(num_ps=2, num_workers=2, checkpoint_root=run_dir) as cluster:
            await train(cluster.resolver, run_dir, args.epochs, args.steps_per_epoch)


if __name__ == "__main__":
    pstrain.run(main())
