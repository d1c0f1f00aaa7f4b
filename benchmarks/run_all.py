"""`make bench`: every workload of WORKLOADS.md, results in benchmarks/results/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "dispatch.py",
    "transfer.py",
    "train_dense.py",
    "train_embedding.py",
    "scaling.py",
    "frameworks.py",
    "elastic_ps.py",
    "elastic_tables.py",
]

if __name__ == "__main__":
    failed = []
    for script in SCRIPTS:
        print(f"== {script}", flush=True)
        if subprocess.run([sys.executable, str(HERE / script)], cwd=HERE).returncode:
            failed.append(script)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")
