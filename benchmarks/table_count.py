"""What each table costs a step: a collection of T small tables, one single-hot feature
each, against the same tables' compute alone, for T up to the hundreds production ranking
models have.

Each T: ``EmbeddingCollection`` of T tables of 10,000 x 16 float32 (placed whole, spread
over 2 ps), a batch of 512 examples, Adagrad, 2 workers with 2 closures in flight, tasks
pinned as in W8; each step pools every feature on the worker and sends every table's
gradient (one request per ps each way). Measured: CPU per step of all five processes over
the timed steps, against the compute alone of the same steps in one process of one thread
with no network (each table's distinct ids, its rows gathered and pooled, the pooled
gradient scattered back, Adagrad on the rows); and the same features sharing one table of
T x 10,000 rows (each feature's ids in rows of its own: what batching the tables into one
would send), against its own compute alone. The four alternate in rounds; medians. The
summary fits each against T: the CPU each table (or feature) adds to a step.

    python benchmarks/table_count.py [--tables 26 104 416] [--rounds 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import pstrain
from pstrain import EmbeddingCollection, JaggedTensor, KeyedJaggedTensor, TableConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, emit, median, one_thread_run, plot, stat_cpu_seconds  # noqa: E402

ROWS, DIM, BATCH = 10_000, 16, 512
#: Distinct batches the steps cycle through (made before the clock starts).
BATCHES = 8


def batches(tables: int, shared: bool = False) -> list[KeyedJaggedTensor]:
    """The steps' batches: feature ``f{i}``'s ids in ``[0, ROWS)``, or (``shared``) in its
    own rows of one shared table, ``[i * ROWS, (i + 1) * ROWS)``: the same draws."""
    rng = np.random.default_rng(0)
    return [
        KeyedJaggedTensor.from_jt_dict(
            {
                f"f{i}": JaggedTensor.from_dense(
                    rng.integers(0, ROWS, (BATCH, 1)) + (i * ROWS if shared else 0)
                )
                for i in range(tables)
            }
        )
        for _ in range(BATCHES)
    ]


async def run_pstrain(tables: int, steps: int, shared: bool = False) -> float:
    """CPU milliseconds per step of every process (coordinator, 2 ps, 2 workers); ``shared``:
    the features share one table of ``tables * ROWS`` rows, each feature's ids in rows of
    its own (what batching the tables into one would send and compute)."""
    async with pstrain.LocalCluster(num_ps=2, num_workers=2, pin_cpus=True) as cluster:
        pids = [os.getpid()] + [cluster.pid(job, i) for job in ("ps", "worker") for i in range(2)]
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        async with strategy.scope():
            optimizer = pstrain.optimizers.Adagrad(0.05)
            features = [f"f{i}" for i in range(tables)]
            collection = EmbeddingCollection(
                [TableConfig("shared", tables * ROWS, DIM, features)]
                if shared
                else [TableConfig(f"table{i}", ROWS, DIM, [f]) for i, f in enumerate(features)]
            )
        made = batches(tables, shared)
        gradient = np.full((BATCH, tables * DIM), 1e-3, np.float32)

        async def step(k: int) -> None:
            pooled = await collection.lookup(made[k % BATCHES])
            await collection.apply_gradients(pooled.gradients(gradient), optimizer)

        for k in range(max(10, steps // 10)):
            coordinator.schedule(step, args=(k,))
        await coordinator.join()
        cpu = sum(stat_cpu_seconds(f"/proc/{p}/stat") for p in pids)
        for k in range(steps):
            coordinator.schedule(step, args=(k,))
        await coordinator.join()
        cpu = sum(stat_cpu_seconds(f"/proc/{p}/stat") for p in pids) - cpu
        await coordinator.close()
        return cpu * 1e3 / steps


def compute_alone(tables: int, steps: int, shared: bool = False) -> float:
    """CPU milliseconds per step of the same tables' compute in this process (``shared``:
    of the features sharing one table), as the collection computes it: each table's
    distinct ids over its features, its rows gathered, each feature pooled, the pooled
    gradient scattered back into the table's rows, Adagrad on them."""
    from pstrain._embeddings.pooling import Bags
    from pstrain._formats.numerics.optimizer_rules import RULES
    from pstrain._kernels.batches import take_rows

    rng = np.random.default_rng(0)
    names = [f"f{i}" for i in range(tables)]
    groups = [names] if shared else [[f] for f in names]
    params = [rng.uniform(-0.05, 0.05, (ROWS * len(g), DIM)).astype(np.float32) for g in groups]
    accumulators = [np.full_like(p, 0.1) for p in params]
    adagrad, cfg = RULES["adagrad"], {"learning_rate": 0.05, "epsilon": 1e-7}
    made = batches(tables, shared)
    gradient = np.full((BATCH, tables * DIM), 1e-3, np.float32)
    column = {f: i * DIM for i, f in enumerate(names)}

    def one(k: int) -> None:
        batch = made[k % BATCHES]
        found = [Bags.sharing([batch[f] for f in g], "sum", np.float32, BATCH) for g in groups]
        pooled = np.zeros((BATCH, tables * DIM), np.float32)
        for g, (unique, bags), p in zip(groups, found, params):
            rows = take_rows(p, unique)
            for f, b in zip(g, bags):
                b.pool(rows, pooled, column[f])
        for g, (unique, bags), p, acc in zip(groups, found, params, accumulators):
            grad = np.zeros((unique.size, DIM), np.float32)
            for f, b in zip(g, bags):
                b.backward(gradient, grad, column[f], DIM)
            adagrad(p, grad, unique.astype(np.int64), {"accumulator": acc}, cfg, k + 1)

    for k in range(10):
        one(k)
    started = time.process_time()
    for k in range(steps):
        one(k)
    return (time.process_time() - started) * 1e3 / steps


def alone_round(tables: int, steps: int, shared: bool = False) -> float:
    got = one_thread_run(
        __file__,
        ["--alone", str(tables), "--steps", str(steps), *(["--shared"] if shared else [])],
        "table_count: the compute alone",
    )
    return float(got["cpu_ms_per_step"])


#: What each round measures: the tables, the features sharing one table, and each one's
#: compute alone.
KINDS = ("tables", "shared", "alone", "shared_alone")


def measure(kind: str, tables: int, steps: int) -> float:
    """CPU milliseconds per step of one of ``KINDS``."""
    if kind in ("alone", "shared_alone"):
        return alone_round(tables, steps, shared=kind == "shared_alone")
    return pstrain.run(run_pstrain(tables, steps, shared=kind == "shared"))


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", type=int, nargs="+", default=[26, 104, 416])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--alone", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--shared", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.alone:
        print(json.dumps({"cpu_ms_per_step": compute_alone(args.alone, args.steps, args.shared)}))
        return
    rows: list[dict[str, Any]] = []
    for tables in args.tables:
        got: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for r in range(args.rounds):  # alternated, the order turned each round
            for k in range(len(KINDS)):
                kind = KINDS[(k + r) % len(KINDS)]
                got[kind].append(measure(kind, tables, args.steps))
        mine, shared, alone, shared_alone = got["tables"], got["shared"], got["alone"], got["shared_alone"]
        row = {
            "tables": tables,
            "batch": BATCH,
            "steps": args.steps,
            "cpu_ms_per_step": round(median(mine), 3),
            "cpu_ms_per_step_each_round": [round(x, 3) for x in mine],
            "compute_alone_cpu_ms_per_step": round(median(alone), 3),
            "compute_alone_each_round": [round(x, 3) for x in alone],
            "cpu_over_compute_alone": round(median(mine) / median(alone), 3),
            "shared_table_cpu_ms_per_step": round(median(shared), 3),
            "shared_table_each_round": [round(x, 3) for x in shared],
            "shared_table_compute_alone_cpu_ms_per_step": round(median(shared_alone), 3),
            "shared_table_compute_alone_each_round": [round(x, 3) for x in shared_alone],
            "shared_table_over_compute_alone": round(median(shared) / median(shared_alone), 3),
        }
        emit(row, "table-count")
        rows.append(row)
    if len(rows) > 1:
        xs = [r["tables"] for r in rows]
        per_table = slope(xs, [r["cpu_ms_per_step"] for r in rows]) * 1e3
        alone_per_table = slope(xs, [r["compute_alone_cpu_ms_per_step"] for r in rows]) * 1e3
        shared_per_feature = slope(xs, [r["shared_table_cpu_ms_per_step"] for r in rows]) * 1e3
        shared_alone_per_feature = (
            slope(xs, [r["shared_table_compute_alone_cpu_ms_per_step"] for r in rows]) * 1e3
        )
        emit(
            {
                "summary": True,
                "tables": xs,
                "cpu_us_per_table_per_step": round(per_table, 1),
                "compute_alone_us_per_table_per_step": round(alone_per_table, 1),
                "per_table_over_compute_alone": round(per_table / alone_per_table, 2),
                "shared_table_us_per_feature_per_step": round(shared_per_feature, 1),
                "shared_table_compute_alone_us_per_feature_per_step": round(shared_alone_per_feature, 1),
            },
            "table-count",
        )
        plot(
            RESULTS / "table-count.png",
            f"CPU per step against tables (batch {BATCH}, one single-hot feature each)",
            "tables (features)",
            "CPU ms per step (medians)",
            {
                "pstrain, all processes": (xs, [r["cpu_ms_per_step"] for r in rows]),
                "pstrain, the features sharing one table": (
                    xs,
                    [r["shared_table_cpu_ms_per_step"] for r in rows],
                ),
                "the compute alone": (xs, [r["compute_alone_cpu_ms_per_step"] for r in rows]),
                "the features sharing one table, its compute alone": (
                    xs,
                    [r["shared_table_compute_alone_cpu_ms_per_step"] for r in rows],
                ),
            },
        )


if __name__ == "__main__":
    main()
