"""W4 embedding: the CTR model of examples/ctr_embedding.py, 2 ps + 2 workers, 1,000 steps.

python benchmarks/train_embedding.py [--steps 1000] [--workers 2] [--runs 1]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pstrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import emit, stat_cpu_seconds  # noqa: E402
from ctr_embedding import train  # noqa: E402


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (from /proc)."""
    return sum(stat_cpu_seconds(f"/proc/{pid}/stat") for pid in pids)


async def run(steps: int, workers: int, max_inflight: int) -> dict:
    async with pstrain.LocalCluster(num_ps=2, num_workers=workers) as cluster:
        pids = [os.getpid()] + [
            cluster.pid(job, i) for job, n in (("ps", 2), ("worker", workers)) for i in range(n)
        ]
        return await train(
            cluster.resolver,
            steps,
            quiet=True,
            max_inflight=max_inflight,
            cpu_clock=lambda: cpu_seconds(pids),
        )


def measure(steps: int, workers: int, workload: str = "W4", max_inflight: int = 2) -> dict:
    r = pstrain.run(run(steps, workers, max_inflight))
    row = {
        "workers": workers,
        "ps": 2,
        "metric": "examples_per_s",
        "value": round(r["examples_per_s"], 1),
        "bytes_per_step": round(r["bytes_per_step"]),
        "held_out_log_loss": round(r["held_out_log_loss"], 4),
        "base_rate_log_loss": round(r["base_rate_log_loss"], 4),
        "steps": steps,
        "batch": 512,
        "cpu_ms_per_step": round(r["cpu_ms_per_step"], 2),
        "max_inflight_per_worker": max_inflight,
    }
    emit(row, workload)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--inflight", type=int, default=2, help="closures in flight per worker")
    args = parser.parse_args()
    for _ in range(args.runs):
        measure(args.steps, args.workers, max_inflight=args.inflight)


if __name__ == "__main__":
    main()
