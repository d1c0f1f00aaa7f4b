"""W4 and W5 on a simulated network: every ps and worker in its own network namespace.

The hosts (2 ps, 4 workers) are namespaces on a bridge (``tests/system/netlab.py``; root
needed); the coordinator runs here and reaches them through the bridge. Links are
shaped both ways with ``tc tbf``. For each link speed (unshaped, 10 Gbit/s,
1 Gbit/s), W4 (2 ps, 2 workers) is measured, and W5 (1, 2, 4 workers) at 1 Gbit/s.

Two models the figures are compared with (docs/failures-and-checkpoints.md, "Partitions ..."), from the
bytes per step and the unshaped rate measured in the same run:

* *serial*: a W4 step is a pull (rows and dense weights), compute, then a push
  (gradients), one after the other on its worker, so on a link of ``rate``
  bytes/s it takes ``t = t0 + bytes / rate``: ``workers * 512 / t`` examples/s;
* *overlapped*: with two steps in flight per worker, one step's transfers run
  while the other computes, so the rate is the smaller of the unshaped rate and
  what the links carry: ``workers * 512 * rate / bytes`` for the worker links.

Each ps link carries half of every step's bytes, so both are also capped at
``512 * rate / (bytes / 2)``.

    python benchmarks/network.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pstrain

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import RESULTS, emit  # noqa: E402
from netlab import NetLab  # noqa: E402

PORT, TOKEN = 7000, "benchmark-network-token-0123456789"
RATES = {"unshaped": None, "10gbit": 10e9 / 8, "1gbit": 1e9 / 8}


def start_servers(lab: NetLab, hosts: dict[str, tuple[str, int]], cluster_file: str, logdir: str) -> None:
    env = dict(os.environ, PSTRAIN_TOKEN=TOKEN, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for key in ("TF_CONFIG", "PSTRAIN_CONFIG"):
        env.pop(key, None)
    procs = []
    for host, (role, index) in hosts.items():
        with open(os.path.join(logdir, f"{host}.log"), "w") as log:
            procs.append(
                (
                    host,
                    lab.start(
                        host,
                        sys.executable,
                        "-m",
                        "pstrain.cli",
                        "serve",
                        "--role",
                        role,
                        "--index",
                        str(index),
                        "--cluster",
                        cluster_file,
                        "--host",
                        lab.address(host),
                        "--port",
                        str(PORT),
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    ),
                )
            )
    for host, proc in procs:
        line = proc.stdout.readline()
        if not re.search("listening on", line):
            raise SystemExit(f"{host} did not start: see {logdir}/{host}.log")


async def w4(spec: dict, workers: int, steps: int) -> dict:
    from ctr_embedding import train

    sub = {"ps": spec["ps"], "worker": spec["worker"][:workers]}
    resolver = pstrain.SimpleClusterResolver(sub, token=TOKEN)
    return await train(resolver, steps, quiet=True, max_inflight=2)


def shape(lab: NetLab, rate: str | None) -> None:
    for host in lab.hosts:
        inner = f"{lab.tag}h{lab.hosts.index(host)}"
        for ns, dev in ((lab.switch, f"{lab.tag}p{lab.hosts.index(host)}"), (lab.ns(host), inner)):
            if rate is None:
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True
                )
        if rate is not None:
            lab.limit(host, rate)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    hosts = {
        "ps0": ("ps", 0),
        "ps1": ("ps", 1),
        "w0": ("worker", 0),
        "w1": ("worker", 1),
        "w2": ("worker", 2),
        "w3": ("worker", 3),
    }
    rows = []
    with NetLab(list(hosts)) as lab, tempfile.TemporaryDirectory() as tmp:
        spec = {
            "ps": [f"{lab.address(h)}:{PORT}" for h in ("ps0", "ps1")],
            "worker": [f"{lab.address(h)}:{PORT}" for h in ("w0", "w1", "w2", "w3")],
        }
        cluster_file = os.path.join(tmp, "cluster.json")
        with open(cluster_file, "w") as f:
            json.dump({"cluster": spec}, f)
        start_servers(lab, hosts, cluster_file, tmp)
        base: dict[int, dict] = {}
        for label, tc_rate in (("unshaped", None), ("10gbit", "10gbit"), ("1gbit", "1gbit")):
            shape(lab, tc_rate)
            for workers in (2,) if label != "1gbit" else (1, 2, 4):
                t = time.perf_counter()
                r = pstrain.run(w4(spec, workers, args.steps))
                if label == "unshaped":
                    base[workers] = r
                row = {
                    "link": label,
                    "workers": workers,
                    "ps": 2,
                    "metric": "examples_per_s",
                    "value": round(r["examples_per_s"]),
                    "bytes_per_step": round(r["bytes_per_step"]),
                    "held_out_log_loss": round(r["held_out_log_loss"], 4),
                    "steps": args.steps,
                    "wall_s": round(time.perf_counter() - t, 1),
                }
                rate = RATES[label]
                if rate is not None:
                    ref = base[workers]
                    t0 = workers * 512 / ref["examples_per_s"]  # unshaped step time, per worker
                    per_step = ref["bytes_per_step"]
                    ps_bound = 512 * rate / (per_step / 2)  # each ps link carries half a step
                    serial = workers * 512 / (t0 + per_step / rate)  # pull, compute, push in turn
                    link_bound = workers * 512 * rate / per_step  # each worker's link, busy always
                    row["predicted_serial_examples_per_s"] = round(min(serial, ps_bound))
                    row["predicted_overlapped_examples_per_s"] = round(
                        min(ref["examples_per_s"], link_bound, ps_bound)
                    )
                emit(row, "W4-network")
                rows.append(row)
            if label == "unshaped":  # W5's baselines at 1 and 4 workers, unshaped too
                for workers in (1, 4):
                    base[workers] = r = pstrain.run(w4(spec, workers, args.steps))
                    row = {
                        "link": label,
                        "workers": workers,
                        "ps": 2,
                        "metric": "examples_per_s",
                        "value": round(r["examples_per_s"]),
                        "bytes_per_step": round(r["bytes_per_step"]),
                        "held_out_log_loss": round(r["held_out_log_loss"], 4),
                        "steps": args.steps,
                    }
                    emit(row, "W4-network")
                    rows.append(row)
    print(json.dumps(rows, indent=1))
    (RESULTS / "W4-network.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
