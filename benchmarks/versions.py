"""W1 and W2 of two source trees of pstrain, alternated in one run, and the handshake's cost.

A change to the wire (the handshake, the typed messages) must not slow the hot
paths. This runs ``dispatch.py`` (W1) and ``transfer.py`` (W2, 64 MiB) with each
tree first on ``PYTHONPATH`` (so the coordinator, the ps and the workers all run
that tree), alternating which goes first from round to round, and reports the
medians per tree. It also times a connection (TCP connect + handshake + one
``health`` call) against a ``health`` call on an open connection: the difference
is what the handshake costs.

    git worktree add /tmp/old <commit>
    python benchmarks/versions.py --old /tmp/old [--rounds 5]

Results: ``results/versions.jsonl`` (one line per tree and figure, medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEW = HERE.parent

HANDSHAKE = r"""
import asyncio, json, statistics, time
import pstrain
from pstrain.rpc import Channel

async def main():
    async with pstrain.LocalCluster(num_ps=1, num_workers=1) as cluster:
        address = cluster.cluster_spec.task_address("ps", 0)
        task = "/job:ps/replica:0/task:0"
        warm = Channel(address, token=cluster.token, task=task)
        await warm.health()
        fresh, open_ = [], []
        for _ in range(300):
            t = time.perf_counter()
            ch = Channel(address, token=cluster.token, task=task)
            await ch.health()
            fresh.append(time.perf_counter() - t)
            await ch.close()
            t = time.perf_counter()
            await warm.health()
            open_.append(time.perf_counter() - t)
        await warm.close()
        print(json.dumps({"connect_ms": statistics.median(fresh) * 1e3,
                          "call_ms": statistics.median(open_) * 1e3}))

pstrain.run(main())
"""


def _run(tree: Path, args: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree), PSTRAIN_BENCH_TAG="versions")
    out = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=900, cwd=str(HERE)
    )
    if out.returncode:
        raise SystemExit(f"{args} failed on {tree}:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--old", required=True, help="the other source tree (a git worktree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=3000)
    args = parser.parse_args()
    trees = {"old": Path(args.old).resolve(), "new": NEW}
    figures: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for name in order:
            tree = trees[name]
            got = figures[name]
            for row in _run(tree, ["dispatch.py", "--n", str(args.n), "--latency-n", "300"]):
                if row.get("metric") == "closures_per_s":
                    got.setdefault(f"W1 {row['closure']} closures/s", []).append(row["value"])
            for row in _run(tree, ["transfer.py", "--sizes", "64M", "--repeats", "8"]):
                if row.get("metric") == "MiB_per_s":
                    got.setdefault(f"W2 64M {row['side']} {row['op']} MiB/s", []).append(row["value"])
            shake = _run(tree, ["-c", HANDSHAKE])[0]
            got.setdefault("connect+handshake+call ms", []).append(shake["connect_ms"])
            got.setdefault("call on an open connection ms", []).append(shake["call_ms"])
            print(f"round {r + 1} {name}: done", file=sys.stderr, flush=True)
    results = HERE / "results" / "versions.jsonl"
    with open(results, "a", encoding="utf-8") as f:
        for figure in figures["new"]:
            old, new = figures["old"].get(figure, []), figures["new"][figure]
            line = {
                "figure": figure,
                "old_median": statistics.median(old) if old else None,
                "new_median": statistics.median(new),
                "rounds": args.rounds,
                "old_tree": str(trees["old"]),
                "old": old,
                "new": new,
            }
            f.write(json.dumps(line) + "\n")
            ratio = line["new_median"] / line["old_median"] if line["old_median"] else float("nan")
            print(
                f"{figure:34s} old {line['old_median']:10.2f}  new {line['new_median']:10.2f}"
                f"  new/old {ratio:.3f}"
            )


if __name__ == "__main__":
    main()
