"""Real training on in-process clusters: W3 learns, W4 beats the base rate, in numpy and in
the frameworks."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "examples"))

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

    results = {
        f: await train(cluster.resolver, steps=200, quiet=True, framework=f)
        for f in ("numpy", "jax", "torch")
    }
    for framework in ("jax", "torch"):
        r = results[framework]
        assert abs(r["held_out_log_loss"] - results["numpy"]["held_out_log_loss"]) < 0.01, results
        assert r["held_out_log_loss"] < r["base_rate_log_loss"]
        assert r["bytes_per_step"] < 1.1e6
