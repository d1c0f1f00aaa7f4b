"""W8, the DLRM shape: pstrain, TensorFlow's ParameterServerStrategy and TorchRec on CPU in
one session, alternated round by round, against the model's own compute alone.

Each round runs, in an order that rotates from round to round:

* pstrain's W8 (``examples/dlrm.py``: 2 ps, 2 workers, 500 steps, each task on its core:
  ``LocalCluster(pin_cpus=True)``, ``--no-pin`` leaves them anywhere), with the CPU seconds of
  all five processes over the timed steps and the requests and bytes each step sent (its
  closures count them with ``pstrain.count_requests``);
* TensorFlow's (``../shared/anchors/tf_ps.py --workload W8``), given ``--tf-python``;
* TorchRec's pipelined loop (``../shared/anchors/torchrec_w8.py --pipeline``), given
  ``--torchrec-python``;
* the compute alone: the same lookups, pooling, MLP forward and backward and Adagrad
  steps on the same batches, in one process of one thread with no network (its CPU
  seconds per step; the batches are made before the clock starts; malloc keeps freed
  memory as a worker's does).

Medians over the rounds go to ``results/W8.jsonl`` (``ratio_to_tf``, ``ratio_to_torchrec``,
``cpu_over_compute_alone``, ``requests_per_ps_per_step``), every peer line to
``results/W8-peers.jsonl``, and ``results/W8.png`` plots each round. The anchors'
virtual environments are made as ``../shared/anchors/README.md`` says::

    python benchmarks/recsys.py --tf-python "$TFENV/bin/python" \\
        --torchrec-python "$TRENV/bin/python" [--rounds 3] [--steps 500]

Without a peer's Python, that peer is named as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import pstrain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import dlrm  # noqa: E402
from common import (  # noqa: E402
    RESULTS,
    emit,
    median,
    one_thread_run,
    peer_run,
    peer_version,
    plot_rounds,
    stat_cpu_seconds,
)

ANCHORS = HERE.parents[1] / "shared" / "anchors"
SETUP = "the steps of ../shared/anchors/README.md"


async def run_pstrain(steps: int, inflight: int = 2, pin_cpus: bool = True) -> dict[str, Any]:
    async with pstrain.LocalCluster(num_ps=2, num_workers=2, pin_cpus=pin_cpus) as cluster:
        pids = [os.getpid()] + [cluster.pid(job, i) for job in ("ps", "worker") for i in range(2)]
        return await dlrm.train(
            cluster.resolver,
            steps,
            quiet=True,
            max_inflight=inflight,
            cpu_clock=lambda: sum(stat_cpu_seconds(f"/proc/{p}/stat") for p in pids),
        )


def compute_alone(steps: int) -> dict[str, Any]:
    """CPU seconds per step of W8's compute in this process (run it with one thread), with
    malloc keeping freed memory as a worker's does (``pstrain serve --keep-freed``)."""
    from pstrain._embeddings.pooling import Bags
    from pstrain._formats.numerics.optimizer_rules import RULES
    from pstrain._kernels.batches import take_rows
    from pstrain.cli.memory import DEFAULT_KEEP, keep_freed

    keep_freed(DEFAULT_KEEP)
    n = min(steps, 60) * dlrm.BATCH
    (ids, lengths, dense, labels), _ = dlrm.synthetic(n, 0)
    kjt = dlrm.features(ids, lengths)
    rng = np.random.default_rng(0)
    tables = [rng.uniform(-0.05, 0.05, (rows, dlrm.DIM)).astype(np.float32) for rows in dlrm.ROWS]
    table_acc = [np.full_like(t, 0.1) for t in tables]
    mlp = dlrm.initial_mlp()
    mlp_acc = [np.full_like(w, 0.1) for w in mlp]
    adagrad = RULES["adagrad"]
    cfg = {"learning_rate": 0.05, "epsilon": 1e-7}
    batches = []
    order = rng.permutation(n)
    for s in range(n // dlrm.BATCH):
        idx = order[s * dlrm.BATCH : (s + 1) * dlrm.BATCH]
        batches.append((kjt.take(idx), dense[idx], labels[idx]))
    warm = 5
    for i, (batch, x, y) in enumerate(batches):
        if i == warm:
            t0 = time.process_time()
        bags = [Bags(batch[f], "sum") for f in dlrm.FEATURES]
        pooled = np.zeros((dlrm.BATCH, len(bags) * dlrm.DIM), np.float32)  # as the collection pools
        for f, (b, t) in enumerate(zip(bags, tables)):
            b.pool(take_rows(t, b.unique), pooled, f * dlrm.DIM)
        _, _, d_pooled, grads = dlrm.forward_backward(pooled, x, y, mlp)
        for f, (b, t, acc) in enumerate(zip(bags, tables, table_acc)):
            g = b.backward(d_pooled, None, f * dlrm.DIM, dlrm.DIM)
            adagrad(t, g.values, g.indices.astype(np.int64), {"accumulator": acc}, cfg, i + 1)
        for w, g, acc in zip(mlp, grads, mlp_acc):
            adagrad(w, g.astype(np.float32), None, {"accumulator": acc}, cfg, i + 1)
    timed = len(batches) - warm
    return {"cpu_ms_per_step": (time.process_time() - t0) * 1e3 / timed, "steps": timed}


def alone_round(steps: int) -> dict[str, Any]:
    return one_thread_run(
        __file__, ["--compute-alone", "--steps", str(steps)], "recsys: the compute-alone run"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tf-python", default=os.environ.get("TF_PYTHON") or None)
    parser.add_argument("--torchrec-python", default=os.environ.get("TORCHREC_PYTHON") or None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--inflight",
        type=int,
        default=2,
        help="pstrain's closures in flight per worker (1: less stale, slower)",
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="leave pstrain's tasks on any core (default: LocalCluster(pin_cpus=True), ps i and "
        "worker i on core i)",
    )
    parser.add_argument("--compute-alone", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compute_alone:
        print(json.dumps(compute_alone(args.steps)))
        return
    if args.rounds < 1 or args.steps < 50:
        parser.error("--rounds must be at least 1 and --steps at least 50")
    systems = ["pstrain", "alone"]
    versions = {}
    if args.tf_python:
        versions["tf"] = peer_version(
            args.tf_python, "tensorflow", "TensorFlow", "recsys: --tf-python", SETUP
        )
        systems.append("tf")
    if args.torchrec_python:
        versions["torchrec"] = peer_version(
            args.torchrec_python, "torchrec", "TorchRec", "recsys: --torchrec-python", SETUP
        )
        systems.append("torchrec")
    got: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for i in range(args.rounds):
        for system in systems[i % len(systems) :] + systems[: i % len(systems)]:
            if system == "pstrain":
                got[system].append(pstrain.run(run_pstrain(args.steps, args.inflight, not args.no_pin)))
            elif system == "alone":
                got[system].append(alone_round(args.steps))
            elif system == "tf":
                got[system].append(
                    peer_run(
                        [
                            args.tf_python,
                            str(ANCHORS / "tf_ps.py"),
                            "--workload",
                            "W8",
                            "--workers",
                            "2",
                            "--ps",
                            "2",
                            "--repeats",
                            "1",
                            "--steps",
                            str(args.steps),
                        ],
                        "recsys: TensorFlow's W8",
                        "W8-peers.jsonl",
                    )
                )
            else:
                got[system].append(
                    peer_run(
                        [
                            args.torchrec_python,
                            str(ANCHORS / "torchrec_w8.py"),
                            "--processes",
                            "2",
                            "--repeats",
                            "1",
                            "--steps",
                            str(args.steps),
                            "--pipeline",
                        ],
                        "recsys: TorchRec's W8",
                        "W8-peers.jsonl",
                    )
                )
            print(f"round {i + 1}/{args.rounds}: {system} done", file=sys.stderr, flush=True)
    ours = got["pstrain"]
    speed = median([r["examples_per_s"] for r in ours])
    cpu = median([r["cpu_ms_per_step"] for r in ours])
    alone = median([r["cpu_ms_per_step"] for r in got["alone"]])
    row: dict[str, Any] = {
        "workers": 2,
        "ps": 2,
        "metric": "examples_per_s",
        "value": round(speed, 1),
        "examples_per_s_each_round": [round(r["examples_per_s"]) for r in ours],
        "held_out_log_loss": round(median([r["held_out_log_loss"] for r in ours]), 4),
        "held_out_log_loss_each_round": [round(r["held_out_log_loss"], 4) for r in ours],
        "base_rate_log_loss": round(ours[0]["base_rate_log_loss"], 4),
        "cpu_ms_per_step": round(cpu, 2),
        "cpu_ms_per_step_each_round": [round(r["cpu_ms_per_step"], 2) for r in ours],
        "compute_alone_cpu_ms_per_step": round(alone, 2),
        "compute_alone_cpu_ms_per_step_each_round": [round(r["cpu_ms_per_step"], 2) for r in got["alone"]],
        "cpu_over_compute_alone": round(cpu / alone, 3),
        "requests_per_ps_per_step": max(r["requests_per_ps_per_step"] for r in ours),
        "requests_per_step": median([r["requests_per_step"] for r in ours]),
        "bytes_per_step": round(median([r["bytes_per_step"] for r in ours])),
        "ids_per_step": round(median([r["ids_per_step"] for r in ours])),
        "rounds": args.rounds,
        "steps": args.steps,
        "batch": dlrm.BATCH,
        "max_inflight_per_worker": args.inflight,
        "pin_cpus": not args.no_pin,
        "note": "W8 alternated with its peers in one session; medians",
    }
    for peer, key in (("tf", "ratio_to_tf"), ("torchrec", "ratio_to_torchrec")):
        if peer in got:
            theirs = got[peer]
            row[f"{peer}_examples_per_s"] = round(median([r["examples_per_s"] for r in theirs]), 1)
            row[f"{peer}_examples_per_s_each_round"] = [round(r["examples_per_s"]) for r in theirs]
            row[f"{peer}_held_out_log_loss"] = round(median([r["heldout_logloss"] for r in theirs]), 4)
            row[f"{peer}_held_out_log_loss_each_round"] = [round(r["heldout_logloss"], 4) for r in theirs]
            row[key] = round(speed / row[f"{peer}_examples_per_s"], 3)
            row[f"{peer}_version"] = versions[peer]
        else:
            row[key] = None
            row.setdefault("not_run", []).append(f"{peer}: give --{peer}-python")
    emit(row, "W8")
    labels = {"pstrain": "pstrain", "tf": "TensorFlow PS", "torchrec": "TorchRec (CPU, pipelined)"}
    plot_rounds(
        RESULTS / "W8.png",
        {labels[s]: [r["examples_per_s"] for r in got[s]] for s in labels if s in got},
        "W8 (26 tables, multi-hot, pooled), 2 ps + 2 workers, alternated",
    )


if __name__ == "__main__":
    main()
