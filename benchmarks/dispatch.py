"""W1 dispatch: closure round trips through 2 workers (2 ps), against TF and Ray.

``noop`` returns the int 1 and touches nothing; ``incr`` does
``v.assign_add(1.0)`` on a scalar on ps 0. Throughput: N closures scheduled at
once, then ``join()`` (N / seconds from the first schedule to join's return).
Latency: one closure at a time, schedule to its RemoteValue resolving, p50 and
p99. The first 10 % is warm-up. ``incr`` must end exactly at the count scheduled.

    python benchmarks/dispatch.py [--n 5000] [--latency-n 2000] [--inflight 256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import emit

import pstrain


def noop():
    return 1


def make_incr(v):
    async def incr():
        await v.assign_add(1.0)

    return incr


async def throughput(coordinator, fn, n: int) -> tuple[float, float]:
    """Closures per second, and the coordinator process's own CPU microseconds per closure."""
    warm = max(1, n // 10)
    for _ in range(warm):
        coordinator.schedule(fn)
    await coordinator.join()
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        coordinator.schedule(fn)
    await coordinator.join()
    return n / (time.perf_counter() - t), (time.process_time() - cpu) / n * 1e6


async def latency(coordinator, fn, n: int) -> tuple[float, float]:
    lat = []
    for _ in range(n + max(1, n // 10)):
        t = time.perf_counter()
        await coordinator.schedule(fn)
        lat.append(time.perf_counter() - t)
    lat = np.array(lat[max(1, n // 10) :]) * 1e3
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99))


async def bench(n: int, latency_n: int, inflight: int) -> None:
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=inflight)
        async with strategy.scope():
            v = pstrain.Variable(0.0, name="w1_v")
        incr = make_incr(v)
        settings = {"workers": 2, "ps": 2, "max_inflight_per_worker": inflight}
        for name, fn in (("noop", noop), ("incr", incr)):
            before = float(await v.numpy())
            rate, cpu_us = await throughput(coordinator, fn, n)
            extra = {}
            if name == "incr":
                after = float(await v.numpy())
                extra = {
                    "updates_applied": after - before,
                    "updates_scheduled": n + max(1, n // 10),
                    "exact": after - before == n + max(1, n // 10),
                }
            emit(
                {
                    **settings,
                    "closure": name,
                    "metric": "closures_per_s",
                    "value": round(rate, 1),
                    "coordinator_cpu_us_per_closure": round(cpu_us, 2),
                    "n": n,
                    **extra,
                },
                "W1",
            )
            p50, p99 = await latency(coordinator, fn, latency_n)
            emit(
                {
                    **settings,
                    "closure": name,
                    "metric": "latency_ms",
                    "p50": round(p50, 4),
                    "p99": round(p99, 4),
                    "value": round(p50, 4),
                    "n": latency_n,
                },
                "W1",
            )
        await coordinator.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--latency-n", type=int, default=2000)
    parser.add_argument("--inflight", type=int, default=256)
    args = parser.parse_args()
    pstrain.run(bench(args.n, args.latency_n, args.inflight))


if __name__ == "__main__":
    main()
