"""A sequence model as a TorchRec user writes it: each example's click history and the item
to rank, looked up unpooled by an ``EmbeddingCollection`` of ``EmbeddingConfig``\\ s, the
history attended over by the target item (as DIN does), and a torch MLP over the result;
the tables on the ps, the MLP's parameters too.

    python examples/sequence_torchrec.py [--steps 300] [--workers 2] [--ps 2]

The data: 100,000 items in 20 categories; each user prefers one category, and 80 % of the
1 to 30 items of their history come from it (Zipf-distributed within it). The label says
whether the user clicked the target item: mostly yes when it is of the preferred category,
mostly no otherwise, so the model has to look at the history to rank well. The held-out
log loss (printed, with the base rate's) is the exit code's test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import numpy as np
import torch

import pstrain
import pstrain.torch as ptorch
from pstrain import KeyedJaggedTensor

ITEMS, CATEGORIES, DIM, LONGEST, BATCH = 100_000, 20, 16, 30, 256


def synthetic(n: int, seed: int) -> tuple[KeyedJaggedTensor, np.ndarray]:
    """``n`` examples: the features ``history`` (sequences of item ids) and
    ``history_category`` (their categories), ``target`` (one item) and ``category`` (its),
    and the labels."""
    rng = np.random.default_rng(seed)
    category_of = np.arange(ITEMS) % CATEGORIES  # item i is of category i % 20
    preferred = rng.integers(0, CATEGORIES, n)
    lengths = 1 + np.minimum(rng.poisson(8, n), LONGEST - 1)
    owner = np.repeat(np.arange(n), lengths)
    # an item of category c: c + 20 * k, k Zipf-distributed (a few items of each are popular)
    k = np.minimum(rng.zipf(1.3, owner.size) - 1, ITEMS // CATEGORIES - 1)
    own = rng.random(owner.size) < 0.8
    history = np.where(own, preferred[owner], rng.integers(0, CATEGORIES, owner.size)) + CATEGORIES * k
    matches = rng.random(n) < 0.5
    target_category = np.where(matches, preferred, (preferred + rng.integers(1, CATEGORIES, n)) % CATEGORIES)
    target = target_category + CATEGORIES * np.minimum(rng.zipf(1.3, n) - 1, ITEMS // CATEGORIES - 1)
    labels = (rng.random(n) < np.where(matches, 0.85, 0.15)).astype(np.float32)
    ones = np.ones(n, np.int64)
    features = KeyedJaggedTensor.from_lengths_sync(
        ["history", "history_category", "target", "category"],
        np.concatenate([history, category_of[history], target, category_of[target]]),
        np.concatenate([lengths, lengths, ones, ones]),
    )
    return features, labels


def tables() -> list[ptorch.EmbeddingConfig]:
    """TorchRec's configs: each table serves the history and the target alike."""
    return [
        ptorch.EmbeddingConfig(
            num_embeddings=ITEMS,
            embedding_dim=DIM,
            name="items",
            feature_names=["history", "target"],
            weight_init_min=-0.1,
            weight_init_max=0.1,
        ),
        ptorch.EmbeddingConfig(
            num_embeddings=CATEGORIES,
            embedding_dim=DIM,
            name="categories",
            feature_names=["history_category", "category"],
            weight_init_min=-0.1,
            weight_init_max=0.1,
        ),
    ]


class Ranker(torch.nn.Module):
    """DIN's shape: each item is its row plus its category's; the target attends over the
    history, and an MLP reads [attended history, target, their product]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, seqs: dict[str, ptorch.JaggedTensor]) -> torch.Tensor:
        history = seqs["history"].to_padded_dense(LONGEST) + seqs["history_category"].to_padded_dense(LONGEST)
        target = seqs["target"].values() + seqs["category"].values()  # [batch, 16]: one item each
        lengths = seqs["history"].lengths()
        scores = (history @ target.unsqueeze(-1)).squeeze(-1) / DIM**0.5  # [batch, 30]
        scores = scores.masked_fill(torch.arange(LONGEST) >= lengths.unsqueeze(-1), float("-inf"))
        attended = (torch.softmax(scores, dim=1).unsqueeze(-1) * history).sum(1)
        return self.mlp(torch.cat([attended, target, attended * target], dim=1))[:, 0]


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


async def train(resolver: Any, steps: int = 300) -> dict[str, Any]:
    """Train for ``steps`` steps; returns examples/s and the held-out and base-rate log loss."""
    features, labels = synthetic(steps * BATCH, seed=1)
    test_features, test_labels = synthetic(5_000, seed=2)
    strategy = pstrain.ParameterServerStrategy(resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        ec = ptorch.EmbeddingCollection(tables(), device=torch.device("cpu"))
        ranker = Ranker()
        remote = ptorch.RemoteModule(ranker, name="ranker")
        optimizer = pstrain.optimizers.Adagrad(0.5)
    print(ec.plan)

    async def step(iterator: Any) -> float:
        kjt, y = next(iterator)
        await asyncio.gather(ec.pull(kjt), remote.pull())
        logits = ranker(ec(kjt))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(y))
        loss.backward()
        await optimizer.apply_gradients([*ec.gradients(), *remote.gradients()])
        return loss.item()

    workers = strategy.cluster_spec.num_tasks("worker")

    def dataset_fn() -> Any:
        return (
            pstrain.data.Dataset.from_tensor_slices((features, labels))
            .shard(workers, pstrain.get_current_worker_index())
            .shuffle(8 * BATCH)
            .repeat()
            .batch(BATCH, drop_remainder=True)
            .prefetch(2)
        )

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    t0 = time.perf_counter()
    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    await coordinator.join()
    elapsed = time.perf_counter() - t0
    train_loss = float(np.mean([await rv for rv in losses[-20:]]))
    # held out: the coordinator pulls the rows and the parameters itself
    await asyncio.gather(ec.pull(test_features, training=False), remote.pull(training=False))
    with torch.no_grad():
        p = torch.sigmoid(ranker(ec(test_features))).numpy()
    held_out = log_loss(p, test_labels)
    base = log_loss(np.full(test_labels.shape[0], labels.mean()), test_labels)
    await coordinator.close()
    out = {
        "examples_per_s": steps * BATCH / elapsed,
        "train_loss_last": train_loss,
        "held_out_log_loss": held_out,
        "base_rate_log_loss": base,
    }
    print(
        f"sequences (TorchRec style): {steps} steps, {out['examples_per_s']:,.0f} examples/s, "
        f"held-out log loss {held_out:.4f} (base rate {base:.4f})"
    )
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        return await train(pstrain.TFConfigClusterResolver(), args.steps)
    async with pstrain.LocalCluster(num_ps=args.ps, num_workers=args.workers) as cluster:
        return await train(cluster.resolver, args.steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    result = pstrain.run(main(parser.parse_args()))
    sys.exit(0 if result["held_out_log_loss"] < result["base_rate_log_loss"] - 0.05 else 1)
