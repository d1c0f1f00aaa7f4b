"""The cost of ``schedule(..., exactly_once=True)`` on W1 ``incr`` and on W4, in one run.

W1 ``incr`` (``v.assign_add(1.0)`` on ps 0; 2 ps, 2 workers, 256 closures in flight per
worker): closures per second with and without exactly-once, alternating, several rounds
on one cluster; the count must end exactly at the closures scheduled. W4 (the numpy CTR
model): examples per second with and without, alternating, on one cluster each. Medians
are printed and appended to results/W1-exactly-once.jsonl and results/W4-exactly-once.jsonl.

    python benchmarks/exactly_once.py [--n 5000] [--rounds 5] [--w4-steps 400] [--w4-runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pstrain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
from common import emit  # noqa: E402


async def w1(n: int, rounds: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"plain": [], "exactly_once": []}
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=256)
        async with strategy.scope():
            v = pstrain.Variable(0.0, name="count")

        async def incr():
            await v.assign_add(1.0)

        expected = 0
        for _ in range(rounds):
            for mode in ("plain", "exactly_once"):
                for _ in range(n // 10):  # warm-up
                    coordinator.schedule(incr, exactly_once=mode == "exactly_once")
                await coordinator.join()
                t = time.perf_counter()
                for _ in range(n):
                    coordinator.schedule(incr, exactly_once=mode == "exactly_once")
                await coordinator.join()
                rates[mode].append(n / (time.perf_counter() - t))
                expected += n + n // 10
        assert await v.numpy() == expected, "incr must end exactly at the count scheduled"
        await coordinator.close()
    return rates


async def w4(steps: int, exactly_once: bool) -> float:
    from ctr_embedding import build

    from pstrain.ctr import BATCH, synthetic

    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        step, _, _ = await build(strategy)

        def dataset_fn():
            (ids, dense_x, y), _ = synthetic(steps * BATCH, 0)
            return (
                pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y))
                .shuffle(50_000)
                .repeat()
                .batch(BATCH)
            )

        it = iter(coordinator.create_per_worker_dataset(dataset_fn))
        for _ in range(steps // 10):
            coordinator.schedule(step, args=(it,), exactly_once=exactly_once)
        await coordinator.join()
        t = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step, args=(it,), exactly_once=exactly_once)
        await coordinator.join()
        rate = steps * BATCH / (time.perf_counter() - t)
        await coordinator.close()
        return rate


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--w4-steps", type=int, default=400)
    parser.add_argument("--w4-runs", type=int, default=3)
    args = parser.parse_args()
    rates = pstrain.run(w1(args.n, args.rounds))
    for mode, xs in rates.items():
        emit(
            {
                "metric": "closures_per_s",
                "closure": "incr",
                "mode": mode,
                "value": round(statistics.median(xs)),
                "runs": [round(x) for x in xs],
                "n": args.n,
                "max_inflight_per_worker": 256,
            },
            "W1-exactly-once",
        )
    w4_rates: dict[str, list[float]] = {"plain": [], "exactly_once": []}
    for _ in range(args.w4_runs):
        for mode in ("plain", "exactly_once"):
            w4_rates[mode].append(pstrain.run(w4(args.w4_steps, mode == "exactly_once")))
    for mode, xs in w4_rates.items():
        emit(
            {
                "metric": "examples_per_s",
                "mode": mode,
                "value": round(statistics.median(xs)),
                "runs": [round(x) for x in xs],
                "steps": args.w4_steps,
                "batch": 512,
            },
            "W4-exactly-once",
        )


if __name__ == "__main__":
    main()
