"""The compiled kernels' build, seen from a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_a_missing_build_is_an_error_that_says_how_to_build_it():
    code = (
        "import sys; sys.modules['pstrain._kernels.compiled'] = None\n"
        "import pstrain, pstrain.server.ps.tables.dynamic_table"
    )  # what a ps loads
    env = {k: v for k, v in os.environ.items() if k != "PSTRAIN_KERNELS"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode != 0
    assert "compiled table kernels" in run.stderr and "pip install -e ." in run.stderr, run.stderr
    assert "PSTRAIN_KERNELS=numpy" in run.stderr
    run = subprocess.run(
        [sys.executable, "-c", code + "; print(pstrain._kernels.KERNELS.__name__)"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PSTRAIN_KERNELS": "numpy"},
    )
    assert run.stdout.strip() == "pstrain._kernels.reference", run.stderr


def test_io_uring_reads_are_off_with_the_variable(tmp_path):
    """``PSTRAIN_IO_URING=0``: the reads are ``pread`` calls, and ``io_uring_reads`` says so."""
    path = tmp_path / "segment"
    path.write_bytes(bytes(range(256)) * 8)
    script = (
        "import os, numpy as np\n"
        "from pstrain._kernels import compiled\n"
        f"fd = os.open({str(path)!r}, os.O_RDONLY)\n"
        "out = np.zeros((2, 256), np.uint8)\n"
        "assert compiled.pread_records(fd, np.array([1, 5], np.int64), 256, out) == 0\n"
        "assert (out == np.arange(256, dtype=np.uint8)).all()\n"
        "print(compiled.io_uring_reads())\n"
    )
    env = {**os.environ, "PSTRAIN_IO_URING": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
