"""W4 embedding: the CTR model of examples/ctr_embedding.py, 2 ps + 2 workers, 1,000 steps.

    python benchmarks/train_embedding.py [--steps 1000] [--workers 2] [--runs 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pstrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import emit  # noqa: E402
from ctr_embedding import train  # noqa: E402


async def run(steps: int, workers: int) -> dict:
    async with pstrain.LocalCluster(num_ps=2, num_workers=workers) as cluster:
        return await train(cluster.resolver, steps, quiet=True)


def measure(steps: int, workers: int, workload: str = "W4") -> dict:
    r = pstrain.run(run(steps, workers))
    row = {"workers": workers, "ps": 2, "metric": "examples_per_s",
           "value": round(r["examples_per_s"], 1), "bytes_per_step": round(r["bytes_per_step"]),
           "held_out_log_loss": round(r["held_out_log_loss"], 4),
           "base_rate_log_loss": round(r["base_rate_log_loss"], 4), "steps": steps, "batch": 512}
    emit(row, workload)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.runs):
        measure(args.steps, args.workers)


if __name__ == "__main__":
    main()
