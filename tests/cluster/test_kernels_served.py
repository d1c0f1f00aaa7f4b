"""The compiled kernels as a ps runs them for a client's request."""

from __future__ import annotations

import numpy as np
import pytest

import pstrain
from pstrain._kernels import KERNELS
from pstrain.testing import InProcessCluster

pytestmark = pytest.mark.timeout(180)


async def test_a_sparse_step_sent_by_a_client_runs_the_fused_kernel(monkeypatch):
    # Row ids travel as int32 (half the bytes); the ps must still take the fused kernel, not
    # numpy's three passes (it did not: W4's and W7's fixed tables ran on numpy).

    calls = []
    fused = KERNELS.adagrad_rows
    monkeypatch.setattr(KERNELS, "adagrad_rows", lambda *a: (calls.append(a[2].dtype), fused(*a))[1])
    rows = np.array([3, 1, 900, 4], np.int64)
    grad = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        async with strategy.scope():
            table = pstrain.Variable(np.ones((1000, 4), np.float32), name="t")
            opt = pstrain.optimizers.Adagrad(0.1)
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, rows), table)])
        got = await table.numpy()
    assert calls == [np.dtype(np.int64)] * 2  # one step on each shard
    want = np.ones((1000, 4), np.float32)  # Adagrad's rule, as the numpy reference writes it
    acc = np.float32(0.1) + grad * grad
    want[rows] -= np.float32(0.1) * grad / np.sqrt(acc + np.float32(1e-7))
    np.testing.assert_array_equal(got, want)
