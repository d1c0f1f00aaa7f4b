"""What the dashboard costs the coordinator: W1 throughput with the dashboard open (a client
reading its event stream, in another process) and closed, alternated in one run.

    python benchmarks/dashboard_overhead.py [--n 20000] [--rounds 5]

Prints one JSON line per closure kind with the median closures/s of each side and their
ratio (results/W1-dashboard.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys

from common import emit
from dispatch import make_incr, noop, throughput

import pstrain


async def bench(n: int, rounds: int, inflight: int) -> None:
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=inflight)
        async with strategy.scope():
            v = pstrain.Variable(0.0, name="w1_v")
        incr = make_incr(v)
        for step in range(200):  # some scalars on the page, as in training
            pstrain.summary.scalar("loss", 1.0 / (step + 1), step=step)
        await pstrain.dashboard.serve_dashboard(coordinator)
        results: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            for side in ("closed", "open") if r % 2 == 0 else ("open", "closed"):  # cancels drift
                watcher = None
                if side == "open":  # a browser's stream, from another process
                    url = pstrain.dashboard.login_url(coordinator)  # each login URL works once
                    watcher = subprocess.Popen(
                        [sys.executable, "-c", WATCH, url], stdout=subprocess.PIPE, text=True
                    )
                    assert watcher.stdout is not None
                    # the first event arrived: the stream is open (read off the loop it needs)
                    await asyncio.get_running_loop().run_in_executor(None, watcher.stdout.readline)
                for name, fn in (("noop", noop), ("incr", incr)):
                    rate, cpu_us = await throughput(coordinator, fn, n)
                    results.setdefault((name, side), []).append(rate)
                    cpu.setdefault((name, side), []).append(cpu_us)
                if watcher is not None:
                    watcher.terminate()  # the watcher this run started, by its PID
                    watcher.wait(10)
                    watcher.stdout.close()  # type: ignore[union-attr]
        served = pstrain.dashboard.of(coordinator)
        snapshots = served.snapshots if served is not None else 0
        await coordinator.close()
    for name in ("noop", "incr"):
        closed = statistics.median(results[(name, "closed")])
        opened = statistics.median(results[(name, "open")])
        emit(
            {
                "workers": 2,
                "ps": 2,
                "closure": name,
                "metric": "closures_per_s_dashboard_open",
                "value": round(opened, 1),
                "closed": round(closed, 1),
                "ratio_open_to_closed": round(opened / closed, 4),
                "rounds": rounds,
                "n": n,
                "max_inflight_per_worker": inflight,
                "snapshots_sent": snapshots,
                "coordinator_cpu_us_per_closure_open": round(statistics.median(cpu[(name, "open")]), 2),
                "coordinator_cpu_us_per_closure_closed": round(statistics.median(cpu[(name, "closed")]), 2),
                "open_runs": [round(x) for x in results[(name, "open")]],
                "closed_runs": [round(x) for x in results[(name, "closed")]],
            },
            "W1-dashboard",
        )


#: The watcher: log in with the one-time URL, then read the event stream until killed.
WATCH = """
import sys, urllib.request, http.cookiejar
jar = http.cookiejar.CookieJar()
opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
opener.open(sys.argv[1]).read()
stream = opener.open(sys.argv[1].split("/login")[0] + "/events")
for line in stream:
    if line.startswith(b"data:"):
        print("event", flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inflight", type=int, default=256)
    args = parser.parse_args()
    pstrain.run(bench(args.n, args.rounds, args.inflight))


if __name__ == "__main__":
    main()
