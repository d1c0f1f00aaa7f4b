"""Restores of a table larger than its ps's memory budget: time against a plain read of the
checkpoint's files, and each ps's memory while it restores.

For each table size, a real cluster (2 ps, 1 worker) trains a ``DynamicEmbedding`` of 32
floats with Adagrad: every row admitted and stepped once, then a base checkpoint (the table
and the optimizer) and ``--deltas`` deltas of a few Zipf-id steps each. The same chain is
then restored ``--repeats`` times, each against a plain sequential read of its files, both
from disk (their pages dropped from the page cache first), once on ps with
``--memory-budget`` (tiered: the base read a piece at a time, the rows past the hot set
written to disk as they come) and once on ps without (the rows wholly in RAM). Each ps's
RSS is sampled every 20 ms during each restore: ``peak_rss_over_start_mib`` is the largest
rise over its RSS just before. Medians; ``results/tiered_restore.jsonl`` and
``results/tiered_restore.png`` (peak rise against the chain's size, the budget drawn).

    python benchmarks/tiered_restore.py [--rows 500000,1000000,2000000] [--budget 128MiB]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import RESULTS, emit, median, plot
from dynamic_tables import peak_rss, rss_mib
from tiered_tables import plain_read_s, uncache

import pstrain
from pstrain._base.checks import byte_size

DIM, BATCH = 32, 65536


async def _chain(root: str, rows: int, deltas: int, **options: Any) -> dict[str, Any]:
    """The restores of a base of ``rows`` rows and ``deltas`` deltas on a cluster made with
    ``options``: seconds, plain reads, and each ps's peak RSS rise, per restore."""
    with tempfile.TemporaryDirectory(dir=root) as ckpt:
        async with pstrain.LocalCluster(num_ps=2, num_workers=1, checkpoint_root=ckpt, **options) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            coordinator = pstrain.ClusterCoordinator(strategy)
            async with strategy.scope():
                table = pstrain.DynamicEmbedding(DIM, name="t")
                opt = pstrain.optimizers.Adagrad(0.05)

            async def step(ids: np.ndarray) -> None:
                await table.lookup(ids)
                grads = np.full((ids.size, DIM), 0.01, np.float32)
                await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])

            every = np.arange(rows, dtype=np.int64) * 0x9E3779B1 + 7
            for start in range(0, rows, BATCH):
                await step(every[start : start + BATCH])
            directory = Path(ckpt) / "chain"
            manager = pstrain.CheckpointManager(
                pstrain.Checkpoint(table=table, optimizer=opt), str(directory), max_to_keep=None
            )
            await manager.save()
            rng = np.random.default_rng(0)
            last = ""
            for _ in range(deltas):
                for _ in range(5):
                    await step(np.unique(rng.zipf(1.1, 4096).astype(np.int64) * 0x9E3779B1))
                last = await manager.save_delta()
            await manager.close()
            files = [f for f in directory.iterdir() if f.is_file()]
            pids = [cluster.pid("ps", k) for k in range(2)]
            out: dict[str, list] = {"restore_s": [], "plain_s": [], "rise_mib": []}
            for _ in range(args.repeats):
                uncache(files)
                start = [rss_mib(p) for p in pids]
                with peak_rss(pids, period_s=0.02) as peak:
                    t = time.perf_counter()
                    await pstrain.Checkpoint(table=table, optimizer=opt).restore(last)
                    out["restore_s"].append(time.perf_counter() - t)
                out["rise_mib"].append(max(b - a for a, b in zip(start, peak)))
                uncache(files)
                out["plain_s"].append(plain_read_s(files))
            out["chain_bytes"] = sum(f.stat().st_size for f in files)
            await coordinator.close()
            return out


async def run() -> None:
    budget = byte_size(args.budget, "--budget")
    sizes = [int(x) for x in args.rows.split(",")]
    series: dict[str, tuple[list, list]] = {"tiered": ([], []), "wholly in RAM": ([], [])}
    with tempfile.TemporaryDirectory(prefix="pstrain-restore-") as root:
        for rows in sizes:
            row: dict[str, Any] = {"metric": "tiered_restore", "rows": rows, "deltas": args.deltas}
            with tempfile.TemporaryDirectory(dir=root) as tier:
                tiered = await _chain(root, rows, args.deltas, memory_budget=budget, table_dir=tier)
            in_ram = await _chain(root, rows, args.deltas)
            for name, got in (("tiered", tiered), ("in_ram", in_ram)):
                ratios = [p / r for p, r in zip(got["plain_s"], got["restore_s"])]
                row[f"{name}_restore_over_plain_read"] = round(median(ratios), 3)
                row[f"{name}_peak_rss_over_start_mib"] = round(median(got["rise_mib"]))
            row.update(
                chain_bytes=tiered["chain_bytes"],
                budget_bytes=budget,
                tiered_peak_rss_over_budget=round(median(tiered["rise_mib"]) / (budget / 2**20), 3),
                repeats=args.repeats,
            )
            emit(row, "tiered_restore")
            mb = tiered["chain_bytes"] / 1e6
            series["tiered"][0].append(mb)
            series["tiered"][1].append(row["tiered_peak_rss_over_start_mib"])
            series["wholly in RAM"][0].append(mb)
            series["wholly in RAM"][1].append(row["in_ram_peak_rss_over_start_mib"])
    plot(
        RESULTS / "tiered_restore.png",
        "A restore's memory: each ps's peak RSS rise while it restores",
        "checkpoint chain (MB: a base and its deltas, both ps)",
        "peak RSS rise of a ps (MiB)",
        series,
        hline=("the tiered ps' budget", budget / 2**20),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="500000,1000000,2000000")
    parser.add_argument("--budget", default="128MiB")
    parser.add_argument("--deltas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run())
