"""W5 scaling: W4 with 1, 2 and 4 workers (2 ps); examples/s and speed-up over 1 worker.

python benchmarks/scaling.py [--steps 1000] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse

from common import RESULTS, plot
from train_embedding import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    rates = [measure(args.steps, w, "W5")["value"] for w in counts]
    for w, r in zip(counts, rates):
        print(f"{w} worker(s): {r:,.0f} examples/s, speed-up {r / rates[0]:.2f}x")
    tf = {1: 37_200, 2: 46_700, 4: 54_100}
    plot(
        RESULTS / "W5.png",
        "W5: W4 examples/s against workers (2 ps)",
        "workers",
        "examples/s",
        {
            "pstrain": (counts, rates),
            "TensorFlow PS (ANCHORS.md)": (
                [w for w in counts if w in tf],
                [tf[w] for w in counts if w in tf],
            ),
        },
    )


if __name__ == "__main__":
    main()
