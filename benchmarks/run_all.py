"""`make bench`: every workload of WORKLOADS.md written so far (W1-W9; W9 in its
dynamic-table form: pstrain does not tier W7's fixed table yet), results in
benchmarks/results/.

    python benchmarks/run_all.py [--only W4,W6] [--tf-python PATH] [--list]

Each workload's script runs in its own process, one after the other (they measure the
machine: nothing else should run meanwhile). W6 runs five rotated rounds of W4, (b) and
the other variants (the ratio to W4 is a ratio of medians in one run); W7 needs about
8 GiB of memory and 13 GiB of free disk beside this file, checked before it starts.
With ``--tf-python`` (``make bench TF_PYTHON=...``: a virtual environment with
tensorflow-cpu 2.21, ``against_tf.py`` says how to make one), W4 is also run against
TensorFlow's ParameterServerStrategy in the same session; without it that comparison is
named as not run. W8 (``recsys.py``) runs against TensorFlow and TorchRec when given
their Pythons (``--tf-python``, ``--torchrec-python``; env TF_PYTHON, TORCHREC_PYTHON);
without one, that peer is named as not run. The last lines say what ran, what failed and
what was not run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30

#: (workload, script, its arguments), in the order they run.
JOBS: list[tuple[str, str, list[str]]] = [
    ("W1", "dispatch.py", []),
    ("W2", "transfer.py", []),
    ("W3", "train_dense.py", []),
    ("W4", "train_embedding.py", []),
    ("W5", "scaling.py", []),
    ("W6", "dynamic_tables.py", ["--runs", "5"]),
    ("W7", "large_table.py", []),
    ("W7", "large_table_deltas.py", []),
    ("W8", "recsys.py", []),
    ("W8", "pooling_placement.py", []),
    ("W9", "tiered_tables.py", ["--steps", "300", "--budget", "40MiB", "--runs", "3"]),
    ("frameworks", "frameworks.py", []),
    ("elastic", "elastic_ps.py", []),
    ("elastic", "elastic_tables.py", []),
]
#: Workloads of WORKLOADS.md with no script yet, and the issue that brings it: named as
#: not run in every plan, never left out in silence.
NOT_WRITTEN: dict[str, str] = {}
#: What W7's scripts need (their docstrings): memory, and disk where they write (beside this file).
W7_MEMORY, W7_DISK = 8 * GIB, 13 * GIB


def w7_room() -> str | None:
    """Why W7 cannot run here (too little memory or disk), or None."""
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    free = shutil.disk_usage(HERE).free
    if available < W7_MEMORY:
        return f"{available / GIB:.1f} GiB of memory available, W7 needs {W7_MEMORY // GIB}"
    if free < W7_DISK:
        return f"{free / GIB:.1f} GiB of disk free under {HERE}, W7 needs {W7_DISK // GIB}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = sorted({w for w, _, _ in JOBS} | {"tf"})
    parser.add_argument(
        "--only",
        default=os.environ.get("BENCH") or None,
        help=f"comma-separated, of {', '.join(names)} (default: all; env BENCH)",
    )
    parser.add_argument(
        "--tf-python",
        default=os.environ.get("TF_PYTHON") or None,
        help="a Python with tensorflow-cpu 2.21: W4 against TensorFlow too (env TF_PYTHON)",
    )
    parser.add_argument(
        "--torchrec-python",
        default=os.environ.get("TORCHREC_PYTHON") or None,
        help="a Python with torchrec 1.9.2: W8 against TorchRec too (env TORCHREC_PYTHON)",
    )
    parser.add_argument("--list", action="store_true", help="print what would run, and stop")
    args = parser.parse_args()
    chosen = set(names) if args.only is None else {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = chosen - set(names)
    if unknown or not chosen:
        parser.error(f"--only {args.only!r}: unknown {sorted(unknown)}; choose among {', '.join(names)}")
    jobs = [(w, script, extra) for w, script, extra in JOBS if w in chosen]
    not_run: list[str] = []
    if "tf" in chosen:
        if args.tf_python:
            jobs.append(("tf", "against_tf.py", ["--tf-python", args.tf_python]))
        elif args.only is not None:
            parser.error("--only tf needs --tf-python (or TF_PYTHON): see benchmarks/against_tf.py")
        else:
            not_run.append(
                "W4 against TensorFlow (against_tf.py): give TF_PYTHON=<a Python with "
                "tensorflow-cpu 2.21>; against_tf.py says how to make one"
            )
    if any(w == "W8" for w, _, _ in jobs):
        peers = {
            "tf": ("TensorFlow", "TF_PYTHON", args.tf_python),
            "torchrec": ("TorchRec", "TORCHREC_PYTHON", args.torchrec_python),
        }
        extra = []
        for flag, (name, env, python) in peers.items():
            if python:
                extra += [f"--{flag}-python", python]
            else:
                not_run.append(
                    f"W8 against {name} (recsys.py): give {env}=<its Python>; "
                    "../shared/anchors/README.md says how to make one"
                )
        jobs = [(w, script, extra if script == "recsys.py" else e) for w, script, e in jobs]
    if args.only is None:
        not_run += [f"{w} (no script yet): {what}" for w, what in NOT_WRITTEN.items()]
    if any(w == "W7" for w, _, _ in jobs):
        why = w7_room()
        if why is not None:
            if args.only is not None:  # asked for by name: refuse, saying why
                parser.error(f"W7 cannot run here: {why}")
            jobs = [j for j in jobs if j[0] != "W7"]
            not_run.append(f"W7 (large_table.py, large_table_deltas.py): {why}")
    if args.list:
        for w, script, extra in jobs:
            print(w, script, *extra)
        for line in not_run:
            print("not run:", line)
        return 0
    failed, ran = [], []
    for w, script, extra in jobs:
        print(f"== {w}: {script} {' '.join(extra)}", flush=True)
        code = subprocess.run([sys.executable, str(HERE / script), *extra], cwd=HERE).returncode
        if code:
            failed.append(f"{script} (exit {code})")
        else:
            ran.append(script)
    print(f"ran: {', '.join(ran) or 'nothing'}")
    for line in not_run:
        print(f"not run: {line}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
