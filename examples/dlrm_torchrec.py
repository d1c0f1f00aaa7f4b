"""W8 as a TorchRec user writes it: ``EmbeddingBagConfig``\\ s, an ``EmbeddingBagCollection``
over a ``KeyedJaggedTensor``, and the dense arches as a ``torch.nn.Module``, all with their
parameters on the ps (``pstrain.torch``). The same data, tables, layers and Adagrad as
``examples/dlrm.py``, whose MLP is numpy written out by hand.

    python examples/dlrm_torchrec.py [--steps 300] [--workers 2] [--ps 2]

What a TorchRec program changes (the ranking-models guide says why): no
``DistributedModelParallel``; the collection and the dense module are made in
``strategy.scope()``; a step pulls its rows and parameters before the forward pass and
hands the gradients to a pstrain optimizer, applied on the ps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import pstrain
import pstrain.torch as ptorch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dlrm  # noqa: E402  (W8's data, shared with the numpy version)


class DenseArch(torch.nn.Module):
    """The bottom MLP over the dense features (13 -> 64 -> 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(dlrm.DENSE, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16), torch.nn.ReLU()
        )

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.model(dense)


class OverArch(torch.nn.Module):
    """The top MLP over the pooled features and the bottom MLP's output (432 -> 256 -> 64 -> 1)."""

    def __init__(self) -> None:
        super().__init__()
        width = len(dlrm.FEATURES) * dlrm.DIM + 16
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[:, 0]


class DenseModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense_arch, self.over_arch = DenseArch(), OverArch()
        # W8's initial weights: Glorot-uniform from default_rng(1), as examples/dlrm.py's
        weights = dlrm.initial_mlp()
        layers = [m for m in self.modules() if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for layer, w, b in zip(layers, weights[::2], weights[1::2]):
                layer.weight.copy_(torch.from_numpy(w.T.copy()))
                layer.bias.copy_(torch.from_numpy(b))

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.over_arch(torch.cat([pooled, self.dense_arch(dense)], dim=1))


def embedding_bag_configs() -> list[ptorch.EmbeddingBagConfig]:
    """W8's 26 tables as TorchRec configs (uniform in [-0.05, 0.05], as WORKLOADS.md says)."""
    return [
        ptorch.EmbeddingBagConfig(
            num_embeddings=rows,
            embedding_dim=dlrm.DIM,
            name=f"table{f}",
            feature_names=[dlrm.FEATURES[f - 1]],
            weight_init_min=-0.05,
            weight_init_max=0.05,
        )
        for f, rows in enumerate(dlrm.ROWS, 1)
    ]


async def train(resolver: Any, steps: int = 300) -> dict[str, Any]:
    """Train W8 for ``steps`` steps; returns examples/s and held-out and base-rate log loss."""
    directory = Path(tempfile.mkdtemp(prefix="pstrain_w8_torchrec_"))
    train_split, test_split = dlrm.synthetic(steps * dlrm.BATCH)
    dlrm.save(train_split, directory)
    base_rate = float(train_split[3].mean())
    del train_split
    strategy = pstrain.ParameterServerStrategy(resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        ebc = ptorch.EmbeddingBagCollection(tables=embedding_bag_configs(), device=torch.device("cpu"))
        dense_model = DenseModel()
        remote = ptorch.RemoteModule(dense_model, name="dense")
        optimizer = pstrain.optimizers.Adagrad(0.05, initial_accumulator_value=0.1)
    print(ebc.plan)

    async def step(iterator: Any) -> float:
        kjt, dense, labels = next(iterator)
        await asyncio.gather(ebc.pull(kjt), remote.pull())
        pooled = ebc(kjt)
        logits = dense_model(pooled.values(), torch.from_numpy(dense))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels))
        loss.backward()
        await optimizer.apply_gradients([*ebc.gradients(), *remote.gradients()])
        return loss.item()

    where, workers = str(directory), strategy.cluster_spec.num_tasks("worker")

    def dataset_fn() -> Any:
        single, multi, dense, labels = dlrm.load(Path(where))
        return (
            pstrain.data.Dataset.from_tensor_slices((single, multi, dense, labels))
            .shard(workers, pstrain.get_current_worker_index())
            .shuffle(8 * dlrm.BATCH)
            .repeat()
            .batch(dlrm.BATCH, drop_remainder=True)
            .map(lambda single, multi, x, y: (dlrm.batch_features(single, multi), x, y))
            .prefetch(2)
        )

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    warm = max(1, steps // 10)
    for _ in range(warm):
        coordinator.schedule(step, args=(iterator,))
    await coordinator.join()
    t0 = time.perf_counter()
    losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps - warm)]
    await coordinator.join()
    elapsed = time.perf_counter() - t0
    train_loss = float(np.mean([await rv for rv in losses[-20:]]))
    # held out: the coordinator pulls the rows and the parameters itself
    kjt = dlrm.features(test_split[0], test_split[1])
    await asyncio.gather(ebc.pull(kjt, training=False), remote.pull(training=False))
    with torch.no_grad():
        p = torch.sigmoid(dense_model(ebc(kjt).values(), torch.from_numpy(test_split[2]))).numpy()
    held_out = dlrm.log_loss(p, test_split[3])
    base = dlrm.log_loss(np.full(test_split[3].shape[0], base_rate), test_split[3])
    await coordinator.close()
    out = {
        "examples_per_s": (steps - warm) * dlrm.BATCH / elapsed,
        "train_loss_last": train_loss,
        "held_out_log_loss": held_out,
        "base_rate_log_loss": base,
    }
    print(
        f"W8 (TorchRec style): {steps} steps, {out['examples_per_s']:,.0f} examples/s, "
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
    sys.exit(0 if result["held_out_log_loss"] < result["base_rate_log_loss"] else 1)
