"""W8: a DLRM-style ranking model: 26 tables (one per sparse feature), multi-hot bags pooled
by sum, a bottom MLP over 13 dense features and a top MLP over their concatenation.

The tables are a :class:`pstrain.EmbeddingCollection`: the 7 of over 100,000 rows are
row-sharded over the ps, the 19 others placed whole by the planner (``print(model.
embeddings.plan)``). Each step sends one request per ps for every table's rows and the
MLPs' weights, and one per ps for every update (Adagrad, applied on the ps). The MLP's
forward and backward are numpy, written out below; the pooling's backward is the
collection's (``pooled.gradients``).

    python examples/dlrm.py [--steps 500] [--workers 2] [--ps 2]
    pstrain launch --ps 2 --workers 2 -- python examples/dlrm.py --steps 200

The data (WORKLOADS.md's W8: Zipf ids hashed into each table, bags of 1 + min(Poisson(3),
19) ids for features 14..26, a logistic teacher) is drawn once by this process and written
to a temporary directory the workers read (on several hosts: ``--data-dir`` on a shared
file system).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import pstrain
from pstrain import EmbeddingCollection, JaggedTensor, KeyedJaggedTensor, TableConfig

#: Rows of each feature's table: Criteo Kaggle's cardinalities capped at 1,000,000.
ROWS = [
    1460,
    583,
    1000000,
    1000000,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    1000000,
    3194,
    27,
    14992,
    1000000,
    10,
    5652,
    2173,
    4,
    1000000,
    18,
    15,
    286181,
    105,
    142572,
]
FEATURES = [f"f{i}" for i in range(1, 27)]
DIM, DENSE, BATCH = 16, 13, 2048
#: (inputs, outputs) of the bottom MLP's layers, then the top's (ReLU between, sigmoid out).
LAYERS = [(13, 64), (64, 16), (26 * DIM + 16, 256), (256, 64), (64, 1)]


def synthetic(n_train: int, n_test: int = 20_000, seed: int = 7) -> tuple[Any, Any]:
    """W8's data, split by split (training first): ``(ids, lengths, dense, labels)`` with
    ``ids`` a list of 26 int32 arrays (each feature's bags end to end) and ``lengths``
    ``(n, 26)``. Drawn in WORKLOADS.md's order, as the TF and TorchRec anchors draw it."""
    rows = np.array(ROWS, np.int64)
    teacher = [np.random.default_rng(100 + f).standard_normal(rows[f - 1]) for f in range(1, 27)]
    t_dense = np.random.default_rng(0).standard_normal(DENSE)
    rng = np.random.default_rng(seed)

    def split(n: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        lengths = np.ones((n, 26), np.int32)
        lengths[:, 13:] = 1 + np.minimum(rng.poisson(3, (n, 13)), 19)
        ids, logit = [], np.zeros(n)
        for f in range(1, 27):
            bag = lengths[:, f - 1]
            raw = rng.zipf(1.2, int(bag.sum())).astype(np.uint64)
            salt = np.uint64(f * 0xBF58476D1CE4E5B9 & ((1 << 64) - 1))
            with np.errstate(over="ignore"):
                h = raw * np.uint64(0x9E3779B97F4A7C15) + salt
            h ^= h >> np.uint64(31)
            feature_ids = (h % np.uint64(rows[f - 1])).astype(np.int32)
            ids.append(feature_ids)
            t = teacher[f - 1][feature_ids]
            if f > 13:  # the teacher reads each bag's mean
                t = np.add.reduceat(t, np.cumsum(bag) - bag) / bag
            logit += t
        dense = rng.standard_normal((n, DENSE))
        logit = logit / np.sqrt(26) + dense @ t_dense / np.sqrt(DENSE)
        labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return ids, lengths, dense.astype(np.float32), labels

    return split(n_train), split(n_test)


def features(ids: list[np.ndarray], lengths: np.ndarray) -> KeyedJaggedTensor:
    """The 26 features of a split as one KeyedJaggedTensor."""
    return KeyedJaggedTensor.from_jt_dict(
        {name: JaggedTensor(ids[f], lengths[:, f]) for f, name in enumerate(FEATURES)}
    )


def save(split: Any, directory: Path) -> None:
    ids, lengths, dense, labels = split
    for f, a in enumerate(ids):
        np.save(directory / f"ids{f}.npy", a)
    for name, a in (("lengths", lengths), ("dense", dense), ("labels", labels)):
        np.save(directory / f"{name}.npy", a)


#: Features 1..13 hold one id per example; 14..26 hold bags.
SINGLE, MULTI = FEATURES[:13], FEATURES[13:]


def load(directory: Path) -> tuple[np.ndarray, KeyedJaggedTensor, np.ndarray, np.ndarray]:
    """A saved split, read into memory (batches gather from it at random: from a memory
    map, each gather pays the mapping's page faults): (single-hot ids, multi-hot
    features, dense, labels). The 13 single-hot features are one ``(n, 13)`` array, an
    example's ids side by side, as TF's anchor keeps them: a batch gathers one row per
    example instead of one number from each of 13 arrays."""
    ids = [np.load(directory / f"ids{f}.npy") for f in range(26)]
    lengths = np.load(directory / "lengths.npy")
    single = np.ascontiguousarray(np.stack(ids[:13], axis=1))
    multi = KeyedJaggedTensor.from_jt_dict(
        {name: JaggedTensor(ids[f], lengths[:, f]) for f, name in enumerate(FEATURES) if f >= 13}
    )
    return single, multi, np.load(directory / "dense.npy"), np.load(directory / "labels.npy")


def batch_features(single: np.ndarray, multi: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A batch's 26 features as one KeyedJaggedTensor, in the model's order: the
    single-hot ones (bags of one) from the columns of ``single``."""
    jagged = {name: JaggedTensor.from_dense(single[:, f : f + 1]) for f, name in enumerate(SINGLE)}
    jagged.update(multi.to_dict())
    return KeyedJaggedTensor.from_jt_dict({name: jagged[name] for name in FEATURES})


def initial_mlp() -> list[np.ndarray]:
    """The MLPs' weights and biases, Glorot-uniform from default_rng(1) in layer order."""
    rng = np.random.default_rng(1)
    out = []
    for i, o in LAYERS:
        limit = np.sqrt(6 / (i + o))
        out += [rng.uniform(-limit, limit, (i, o)).astype(np.float32), np.zeros(o, np.float32)]
    return out


class DLRM(pstrain.Module):
    """The 26 tables and the two MLPs; create it in ``strategy.scope()``."""

    def __init__(self, optimizer: Any = None) -> None:
        super().__init__()
        self.embeddings = EmbeddingCollection(
            [
                TableConfig(
                    f"table{f}",
                    rows,
                    DIM,
                    [FEATURES[f - 1]],
                    combiner="sum",
                    pooling_factor=1.0 if f <= 13 else 4.0,
                    optimizer=optimizer,
                )
                for f, rows in enumerate(ROWS, 1)
            ]
        )
        self.mlp = [pstrain.Variable(a, name=f"mlp/{i}") for i, a in enumerate(initial_mlp())]


def forward_backward(
    pooled: np.ndarray, dense: np.ndarray, labels: np.ndarray | None, mlp: list[np.ndarray]
) -> tuple[float, np.ndarray, np.ndarray, list[np.ndarray]]:
    """(loss, predictions, the gradient of ``pooled``, the MLP's gradients); ``labels`` None:
    the forward pass only (loss and gradients empty). Each layer's bias and ReLU, and each
    ReLU's gradient, work in place on the product they follow: a batch's activations are
    megabytes, and every temporary array is one more pass over them. For the same reason the
    top MLP's first layer takes the pooled rows and the bottom MLP's output as the two parts
    of its weights, never joined side by side, and the pooled rows' gradient comes straight
    out of its own product."""
    wb1, bb1, wb2, bb2, wt1, bt1, wt2, bt2, wt3, bt3 = mlp
    width = pooled.shape[1]
    wt1_pooled, wt1_bottom = wt1[:width], wt1[width:]

    def relu(out: np.ndarray, b: np.ndarray) -> np.ndarray:
        out += b
        return np.maximum(out, 0, out=out)

    def cut(d_out: np.ndarray, h: np.ndarray) -> np.ndarray:  # through a ReLU: 0 where h was cut
        d_out *= h > 0
        return d_out

    z1 = relu(dense @ wb1, bb1)
    z2 = relu(z1 @ wb2, bb2)
    h1 = pooled @ wt1_pooled  # the concatenation [pooled, z2] @ wt1, in two parts
    h1 += z2 @ wt1_bottom
    h1 = relu(h1, bt1)
    h2 = relu(h1 @ wt2, bt2)
    logit = h2 @ wt3[:, 0]
    logit += bt3[0]
    p = 1 / (1 + np.exp(-logit))
    if labels is None:
        return float("nan"), p, np.zeros(0), []
    n = labels.shape[0]
    loss = float(np.mean(np.logaddexp(0, logit) - labels * logit))  # log loss from the logit
    d = ((p - labels) / n).astype(np.float32)
    g_wt3, g_bt3 = (h2.T @ d)[:, None], d.sum(keepdims=True)
    d_h2 = cut(np.multiply.outer(d, wt3[:, 0]), h2)
    g_wt2, g_bt2 = h1.T @ d_h2, d_h2.sum(0)
    d_h1 = cut(d_h2 @ wt2.T, h1)
    g_wt1 = np.empty_like(wt1)
    np.matmul(pooled.T, d_h1, out=g_wt1[:width])
    np.matmul(z2.T, d_h1, out=g_wt1[width:])
    g_bt1 = d_h1.sum(0)
    d_pooled = d_h1 @ wt1_pooled.T
    d_z2 = cut(d_h1 @ wt1_bottom.T, z2)
    g_wb2, g_bb2 = z1.T @ d_z2, d_z2.sum(0)
    d_z1 = cut(d_z2 @ wb2.T, z1)
    g_wb1, g_bb1 = dense.T @ d_z1, d_z1.sum(0)
    grads = [g_wb1, g_bb1, g_wb2, g_bb2, g_wt1, g_bt1, g_wt2, g_bt2, g_wt3, g_bt3]
    return loss, p, d_pooled, grads


def make_step(model: DLRM, optimizer: Any) -> Any:
    """The step to schedule: ``coordinator.schedule(step, args=(iterator,))``; it returns
    the batch's loss and the requests and bytes it sent to each ps."""
    collection, mlp = model.embeddings, model.mlp

    async def step(iterator: Any) -> dict[str, Any]:
        batch, dense, labels = next(iterator)
        with pstrain.count_requests() as counts:
            pooled = await collection.lookup(batch, read=mlp)
            loss, _, d_pooled, grads = forward_backward(pooled.concat(), dense, labels, pooled.read)
            await collection.apply_gradients([*pooled.gradients(d_pooled), *zip(grads, mlp)], optimizer)
        return {
            "loss": loss,
            "requests_to_ps": counts.to("ps"),
            "ps_tasks": len(counts.per_task),
            "bytes": counts.bytes_sent + counts.bytes_received,
            "ids": int(sum(batch[f].values.size for f in FEATURES)),
        }

    return step


async def evaluate(model: DLRM, test: Any) -> float:
    """Held-out log loss on ``test`` (features, dense, labels)."""
    batch, dense, labels = test
    pooled = await model.embeddings.lookup(batch, read=model.mlp, training=False)
    _, p, _, _ = forward_backward(pooled.concat(), np.asarray(dense), None, pooled.read)
    return log_loss(p, np.asarray(labels))


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


async def train(
    resolver: Any,
    steps: int = 500,
    *,
    data_dir: str | None = None,
    quiet: bool = False,
    max_inflight: int = 2,
    cpu_clock: Any = None,
    shuffle_buffer: int = 8 * BATCH,
) -> dict[str, Any]:
    """Train W8; returns its figures (examples/s, held-out and base-rate log loss, requests
    and bytes per step, CPU per step if ``cpu_clock`` is given)."""
    made = data_dir is None
    directory = Path(data_dir or tempfile.mkdtemp(prefix="pstrain_w8_"))
    t0 = time.perf_counter()
    train_split, test_split = synthetic(steps * BATCH)
    save(train_split, directory)
    test = (features(test_split[0], test_split[1]), test_split[2], test_split[3])
    base_rate = float(train_split[3].mean())
    del train_split
    data_s = time.perf_counter() - t0
    try:
        strategy = pstrain.ParameterServerStrategy(resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=max_inflight)
        async with strategy.scope():
            optimizer = pstrain.optimizers.Adagrad(0.05, initial_accumulator_value=0.1)
            model = DLRM()
        if not quiet:
            print(model.embeddings.plan)
        step = make_step(model, optimizer)
        where = str(directory)
        workers = strategy.cluster_spec.num_tasks("worker")

        def dataset_fn() -> Any:
            # Each worker its share of the examples (an epoch over all workers sees each
            # once), shuffled within a window: the examples are drawn independently, and a
            # batch gathered from a window stays in the caches where one gathered from
            # the whole split waits on memory for every bag.
            single, multi, dense, labels = load(Path(where))
            return (
                pstrain.data.Dataset.from_tensor_slices((single, multi, dense, labels))
                .shard(workers, pstrain.get_current_worker_index())
                .shuffle(shuffle_buffer)
                .repeat()
                .batch(BATCH, drop_remainder=True)
                .map(lambda single, multi, x, y: (batch_features(single, multi), x, y))
                .prefetch(2)
            )

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        warm = max(1, steps // 10)
        t0 = time.perf_counter()
        for _ in range(warm):
            coordinator.schedule(step, args=(iterator,))
        await coordinator.join()
        warmup_s = time.perf_counter() - t0
        cpu_before = cpu_clock() if cpu_clock else 0.0
        t = time.perf_counter()
        rvs = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps - warm)]
        await coordinator.join()
        elapsed = time.perf_counter() - t
        cpu = (cpu_clock() - cpu_before) if cpu_clock else float("nan")
        results = [await rv for rv in rvs]
        held_out = await evaluate(model, test)
        base = log_loss(np.full(test[2].shape[0], base_rate), test[2])
        timed = steps - warm
        out = {
            "examples_per_s": timed * BATCH / elapsed,
            "held_out_log_loss": held_out,
            "base_rate_log_loss": base,
            "train_loss_last": float(np.mean([r["loss"] for r in results[-20:]])),
            "requests_per_ps_per_step": max(r["requests_to_ps"] / r["ps_tasks"] for r in results),
            "requests_per_step": float(np.mean([r["requests_to_ps"] for r in results])),
            "bytes_per_step": float(np.mean([r["bytes"] for r in results])),
            "ids_per_step": float(np.mean([r["ids"] for r in results])),
            "cpu_ms_per_step": cpu * 1e3 / timed,
            "warmup_s": warmup_s,
            "data_s": data_s,
            "steps": steps,
            "batch": BATCH,
        }
        if not quiet:
            print(
                f"W8: {steps} steps, {out['examples_per_s']:,.0f} examples/s, "
                f"{out['requests_per_step']:.1f} requests and {out['bytes_per_step'] / 1e6:.2f} MB "
                f"per step, held-out log loss {held_out:.4f} (base rate {base:.4f})"
            )
        await coordinator.close()
        return out
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        return await train(pstrain.TFConfigClusterResolver(), args.steps, data_dir=args.data_dir)
    async with pstrain.LocalCluster(num_ps=args.ps, num_workers=args.workers) as cluster:
        return await train(cluster.resolver, args.steps, data_dir=args.data_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument(
        "--data-dir", help="a directory every worker can read (default: a temporary one, removed at the end)"
    )
    result = pstrain.run(main(parser.parse_args()))
    sys.exit(0 if result["held_out_log_loss"] < result["base_rate_log_loss"] else 1)
