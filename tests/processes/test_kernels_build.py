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
