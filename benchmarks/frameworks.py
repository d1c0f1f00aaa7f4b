"""W3 and W4 written three ways (hand-written numpy, JAX, PyTorch), measured in one run.

Each run starts its own LocalCluster (2 ps, 2 workers) and trains one model;
the frameworks alternate run by run so that a drift of the machine's speed hits
all three alike. For each: examples/s, CPU ms per step summed over every
process (coordinator, ps, workers; from /proc), held-out quality, and the
warm-up apart from the steady state: ``compile_s`` is the warm-up's wall time
minus what its steps cost at the steady rate (JAX compiles its step there).
Medians over runs are printed and plotted (results/frameworks.png).

    python benchmarks/frameworks.py [--runs 3] [--w3-steps 2000] [--w4-steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import pstrain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
from common import RESULTS, emit  # noqa: E402
from train_embedding import cpu_seconds  # noqa: E402

FRAMEWORKS = ("numpy", "jax", "torch")


async def run(workload: str, framework: str, steps: int, inflight: int) -> dict:
    from ctr_embedding import train as train_w4
    from mnist_mlp import train as train_w3

    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        pids = [os.getpid()] + [cluster.pid(job, i) for job in ("ps", "worker") for i in range(2)]

        def clock() -> float:
            return cpu_seconds(pids)

        if workload == "W3":
            rate, accuracy, extra = await train_w3(
                cluster.resolver, steps, quiet=True, framework=framework, cpu_clock=clock
            )
            return {"examples_per_s": rate, "held_out_accuracy": accuracy, **extra, "batch": 128}
        r = await train_w4(
            cluster.resolver, steps, quiet=True, max_inflight=inflight, cpu_clock=clock, framework=framework
        )
        return {**r, "batch": 512}


def measure(workload: str, framework: str, steps: int, inflight: int) -> dict:
    r = pstrain.run(run(workload, framework, steps, inflight))
    compile_s = max(0.0, r["warmup_s"] - r["warmup_steps"] * r["steady_ms_per_step"] / 1e3)
    row = {
        "framework": framework,
        "workers": 2,
        "ps": 2,
        "steps": steps,
        "batch": r["batch"],
        "metric": "examples_per_s",
        "value": round(r["examples_per_s"], 1),
        "cpu_ms_per_step": round(r["cpu_ms_per_step"], 2),
        "compile_s": round(compile_s, 2),
        "warmup_s": round(r["warmup_s"], 2),
        "max_inflight_per_worker": inflight,
    }
    if workload == "W3":
        row["held_out_accuracy"] = round(r["held_out_accuracy"], 4)
    else:
        row.update(
            held_out_log_loss=round(r["held_out_log_loss"], 4),
            base_rate_log_loss=round(r["base_rate_log_loss"], 4),
            bytes_per_step=round(r["bytes_per_step"]),
        )
    emit(row, f"{workload}-frameworks")
    return row


def plot(summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), dpi=110)
    for ax, key, label in (
        (axes[0], "value", "examples/s (median)"),
        (axes[1], "cpu_ms_per_step", "CPU ms per step, all processes"),
    ):
        width = 0.25
        for i, fw in enumerate(FRAMEWORKS):
            xs = [j + (i - 1) * width for j in range(2)]
            ys = [summary[w][fw][key] for w in ("W3", "W4")]
            ax.bar(xs, ys, width, label=fw)
        ax.set_xticks([0, 1], ["W3 dense MLP", "W4 sparse CTR"])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("The same models, hand-written (numpy), in JAX and in PyTorch (2 ps, 2 workers)")
    fig.tight_layout()
    path = RESULTS / "frameworks.png"
    fig.savefig(path)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--w3-steps", type=int, default=2000)
    parser.add_argument("--w4-steps", type=int, default=1000)
    parser.add_argument("--inflight", type=int, default=2, help="W4 closures in flight per worker")
    args = parser.parse_args()
    rows: dict[str, dict[str, list[dict]]] = {w: {f: [] for f in FRAMEWORKS} for w in ("W3", "W4")}
    for run_index in range(args.runs):
        order = FRAMEWORKS[run_index % 3 :] + FRAMEWORKS[: run_index % 3]  # alternate who goes first
        for workload, steps in (("W3", args.w3_steps), ("W4", args.w4_steps)):
            for fw in order:
                rows[workload][fw].append(measure(workload, fw, steps, args.inflight))
    summary = {
        w: {
            f: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
            for f, rs in per.items()
        }
        for w, per in rows.items()
    }
    print(json.dumps(summary, indent=1))
    plot(summary)


if __name__ == "__main__":
    main()
