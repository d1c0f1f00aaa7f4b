"""The examples as users run them: alone and under ``pstrain launch``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def _temporary_files_in_the_tests_own(tmp_path, monkeypatch):
    """The examples' temporary directories (their checkpoints, data, summaries) go into
    the test's, which pytest removes, not into /tmp."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def run_example(*args: str, launch: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    cmd = [sys.executable, *args]
    if launch:
        cmd = [sys.executable, "-m", "pstrain.cli", "launch", "--ps", "2", "--workers", "2", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env, cwd=EXAMPLES)


def test_tf_doc_example_runs_on_its_own_and_under_launch():
    alone = run_example("tf_doc_example.py")
    assert alone.returncode == 0, alone.stderr
    assert "v1 = 1.1000, v2 = -1.2000" in alone.stdout
    launched = run_example("tf_doc_example.py", launch=True)
    assert launched.returncode == 0, launched.stderr
    assert "[chief] v1 = 1.1000" in launched.stdout


def test_ctr_example_runs_under_launch():
    result = run_example("ctr_embedding.py", "--steps", "150", "--quiet", launch=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("module, says", [("mlp_equinox", "W3 (equinox)"), ("ctr_torch", "W4 (torch)")])
def test_a_framework_model_run_alone_trains_and_says_so(module, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{module}.py"), "--steps", "20", "--ps", "1", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert says in run.stdout, run.stdout + run.stderr


def test_the_w8_example_trains_alone_and_under_launch_with_one_request_per_ps_each_way():
    """``examples/dlrm.py`` (W8: 26 tables, multi-hot bags) learns in a few steps (its exit
    code says whether the held-out loss beat the base rate) and sends a read and an update
    to each of its 2 ps a step, on its own cluster and on one ``pstrain launch`` made."""
    for launch in (False, True):
        run = run_example("dlrm.py", "--steps", "40", launch=launch)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "W8: 40 steps" in run.stdout and "4.0 requests" in run.stdout, run.stdout


def test_the_w8_example_written_as_a_torchrec_user_would_trains():
    """``examples/dlrm_torchrec.py``: W8 with TorchRec's EmbeddingBagConfig and
    EmbeddingBagCollection and the MLPs as torch modules learns in a few steps (its exit code
    says whether the held-out loss beat the base rate)."""
    run = run_example("dlrm_torchrec.py", "--steps", "40")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "W8 (TorchRec style): 40 steps" in run.stdout and "row-sharded" in run.stdout, run.stdout


def test_the_sequence_example_written_as_a_torchrec_user_would_learns_from_the_history():
    """``examples/sequence_torchrec.py``: an EmbeddingCollection's unpooled rows attended
    over by the target item learn whether the user clicks it (its exit code says whether
    the held-out loss beat the base rate's by 0.05)."""
    run = run_example("sequence_torchrec.py", "--steps", "300")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "sequences (TorchRec style): 300 steps" in run.stdout, run.stdout
