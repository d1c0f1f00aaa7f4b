"""W3 dense: the MLP of examples/mnist_mlp.py, 2 ps + 2 workers, 2,000 steps.

python benchmarks/train_dense.py [--steps 2000] [--runs 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pstrain

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import emit  # noqa: E402
from mnist_mlp import train  # noqa: E402


async def run(steps: int) -> tuple[float, float]:
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        return await train(cluster.resolver, steps, quiet=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.runs):
        rate, accuracy = pstrain.run(run(args.steps))
        emit(
            {
                "workers": 2,
                "ps": 2,
                "metric": "examples_per_s",
                "value": round(rate, 1),
                "held_out_accuracy": round(accuracy, 4),
                "steps": args.steps,
                "batch": 128,
            },
            "W3",
        )


if __name__ == "__main__":
    main()
