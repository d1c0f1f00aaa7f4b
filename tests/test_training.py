"""Real training on real processes: W3 learns, W4 beats the base rate; examples run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

pytestmark = pytest.mark.timeout(240)


async def test_w3_mlp_learns(cluster):
    from mnist_mlp import train

    _, accuracy = await train(cluster.resolver, steps=1000, quiet=True)  # speed: benchmarks/
    assert accuracy > 0.85


async def test_w4_ctr_beats_the_base_rate(cluster):
    from ctr_embedding import train

    result = await train(cluster.resolver, steps=200, quiet=True)
    assert result["held_out_log_loss"] < result["base_rate_log_loss"]
    assert result["bytes_per_step"] < 1.1e6  # only looked-up, deduplicated rows travel


@pytest.mark.parametrize("framework", ["jax", "equinox", "torch"])
async def test_w3_written_in_a_framework_learns_as_well(cluster, framework):
    from mnist_mlp import train

    _, accuracy = await train(cluster.resolver, steps=1000, quiet=True, framework=framework)
    assert accuracy > 0.85


async def test_w4_in_jax_and_in_torch_matches_the_numpy_model(cluster):
    """Same data, initial weights and optimizer: the held-out log loss after the same steps
    is within 0.01 of the hand-written model's, and only looked-up rows travel."""
    from ctr_embedding import train

    results = {f: await train(cluster.resolver, steps=200, quiet=True, framework=f)
               for f in ("numpy", "jax", "torch")}
    for framework in ("jax", "torch"):
        r = results[framework]
        assert abs(r["held_out_log_loss"] - results["numpy"]["held_out_log_loss"]) < 0.01, results
        assert r["held_out_log_loss"] < r["base_rate_log_loss"]
        assert r["bytes_per_step"] < 1.1e6


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
    run = subprocess.run([sys.executable, str(EXAMPLES / f"{module}.py"), "--steps", "20", "--ps", "1",
                          "--workers", "1"], capture_output=True, text=True, timeout=170, env=env)
    assert says in run.stdout, run.stdout + run.stderr
