"""W2 transfer: variable bandwidth, against raw loopback TCP measured in the same run.

A float32 variable on ps 0 of a 2 ps + 2 worker cluster. For each size:
``read`` (the whole variable) and ``assign`` (a fresh array), from the
coordinator (``await v.read_value()`` / ``await v.assign(x)``) and from a
closure on a worker (read and return the sum; assign an array the worker
holds). Median of ``--repeats`` after a 10 % warm-up.

    python benchmarks/transfer.py [--sizes 4K,1M,64M,256M] [--repeats 20]
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from common import RESULTS, emit, median, plot, raw_tcp_mib_s

import pstrain

SIZES = {"4K": 4 << 10, "1M": 1 << 20, "64M": 64 << 20, "256M": 256 << 20}


async def _timed(fn, repeats: int) -> float:
    warm = max(1, repeats // 10)
    times = []
    for _ in range(repeats + warm):
        t = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t)
    return median(times[warm:])


def _worker_array(n: int):
    def make():
        return itertools.repeat(np.full(n, 2.0, np.float32))

    return make


async def _read_sum(v):
    return float((await v.read_value()).sum())


async def _assign_held(v, it):
    await v.assign(next(it))


async def bench(sizes: list[str], repeats: int, closures: bool) -> list[dict]:
    rows = []
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        for label in sizes:
            nbytes = SIZES[label]
            n = nbytes // 4
            reps = repeats if nbytes <= (64 << 20) else max(5, repeats // 4)
            tcp_before = raw_tcp_mib_s(nbytes, reps)
            async with strategy.scope():
                v = pstrain.Variable(np.zeros(n, np.float32), name=f"w2_{label}")
            x = np.random.default_rng(0).random(n, dtype=np.float32)
            results = {
                ("coordinator", "read"): await _timed(v.read_value, reps),
                ("coordinator", "assign"): await _timed(lambda v=v, x=x: v.assign(x), reps),
            }
            if closures:
                it = iter(coordinator.create_per_worker_dataset(_worker_array(n)))

                async def closure_read(v=v):
                    await coordinator.schedule(_read_sum, args=(v,))

                async def closure_assign(v=v, it=it):
                    await coordinator.schedule(_assign_held, args=(v, it))

                results[("closure", "read")] = await _timed(closure_read, reps)
                results[("closure", "assign")] = await _timed(closure_assign, reps)
            # The limit: the better of two raw-TCP medians taken around our own measurements.
            tcp = max(tcp_before, raw_tcp_mib_s(nbytes, reps))
            for (side, op), seconds in results.items():
                row = {
                    "workers": 2,
                    "ps": 2,
                    "side": side,
                    "op": op,
                    "size": label,
                    "bytes": nbytes,
                    "seconds": seconds,
                    "metric": "MiB_per_s",
                    "value": round(nbytes / (1 << 20) / seconds, 1),
                    "raw_tcp_MiB_per_s": round(tcp, 1),
                    "share_of_raw_tcp": round(nbytes / (1 << 20) / seconds / tcp, 3),
                    "ms": round(seconds * 1e3, 3),
                }
                emit(row, "W2")
                rows.append(row)
        await coordinator.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4K,1M,64M,256M")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-closures", action="store_true", help="coordinator side only")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    rows = pstrain.run(bench(sizes, args.repeats, not args.no_closures))
    series = {}
    for side in ("coordinator", "closure"):
        for op in ("read", "assign"):
            pts = [(r["bytes"], r["value"]) for r in rows if r["side"] == side and r["op"] == op]
            if pts:
                series[f"{side} {op}"] = ([p[0] for p in pts], [p[1] for p in pts])
    tcp = sorted({(r["bytes"], r["raw_tcp_MiB_per_s"]) for r in rows})
    series["raw TCP (same run)"] = ([t[0] for t in tcp], [t[1] for t in tcp])
    plot(
        RESULTS / "W2.png",
        "W2: variable transfer, 2 ps + 2 workers, loopback",
        "bytes",
        "MiB/s (median)",
        series,
        logx=True,
    )


if __name__ == "__main__":
    main()
