"""pstrain.torch: an nn.Module whose parameters live on the ps, with a sharded embedding;
gradients applied on the ps equal PyTorch's own, and only looked-up rows travel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pstrain
import pstrain.torch as ptorch
from pstrain.partitioners import FixedShardsPartitioner

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    def __init__(self, rows: int, dim: int = 4) -> None:
        super().__init__()
        self.emb = ptorch.Embedding(rows, dim, pstrain.initializers.RandomNormal(0.0, 0.5, seed=1))
        self.fc = torch.nn.Linear(dim * 3 + 2, 1)

    def forward(self, ids, x):
        return torch.tanh(self.fc(torch.cat([self.emb(ids).flatten(1), x], 1)))[:, 0]


def mse_step(net, remote, opt):
    """The training step a user writes: pull, forward, backward, apply on the ps."""

    async def step(ids, x, y):
        await remote.pull({net.emb: ids})
        loss = torch.mean((net(ids, x) - y) ** 2)
        loss.backward()
        await opt.apply_gradients(remote.gradients())
        return loss.item()

    return step


def strategy_for(cluster):
    return pstrain.ParameterServerStrategy(cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


async def test_gradients_applied_on_the_ps_equal_torchs_own(cluster):
    strategy = strategy_for(cluster)
    coordinator = pstrain.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        net = Net(30)
        remote = ptorch.RemoteModule(net)
        opt = pstrain.optimizers.SGD(1.0)
    assert [v.name for v in remote.variables] == ["model/fc.weight", "model/fc.bias"]
    assert isinstance(net.emb.table, pstrain.ShardedVariable)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 30, (6, 3))
    ids[0] = 5  # duplicate ids within and across examples
    ids[3, 1] = 5
    x = torch.from_numpy(rng.normal(size=(6, 2)).astype(np.float32))
    y = torch.from_numpy(rng.normal(size=6).astype(np.float32))
    before = {
        "table": await net.emb.table.numpy(),
        **{n: await v.numpy() for n, v in zip(remote.names, remote.variables)},
    }

    step = mse_step(net, remote, opt)

    loss = await coordinator.schedule(step, args=(ids, x, y))

    # PyTorch's own gradients, on a plain local copy with the whole table
    table = torch.tensor(before["table"], requires_grad=True)
    fc = torch.nn.Linear(14, 1)
    with torch.no_grad():
        fc.weight.copy_(torch.from_numpy(before["fc.weight"]))
        fc.bias.copy_(torch.from_numpy(before["fc.bias"]))
    hidden = torch.cat([table[torch.from_numpy(ids)].flatten(1), x], 1)
    ref = torch.mean((torch.tanh(fc(hidden))[:, 0] - y) ** 2)
    ref.backward()
    assert abs(loss - ref.item()) < 1e-6
    np.testing.assert_allclose(before["table"] - await net.emb.table.numpy(), table.grad.numpy(), atol=1e-5)
    np.testing.assert_allclose(
        before["fc.weight"] - await remote.variables[0].numpy(), fc.weight.grad.numpy(), atol=1e-5
    )
    np.testing.assert_allclose(
        before["fc.bias"] - await remote.variables[1].numpy(), fc.bias.grad.numpy(), atol=1e-5
    )
    await coordinator.close()


async def test_an_nn_module_trains_and_only_looked_up_rows_travel(cluster):
    strategy = strategy_for(cluster)
    coordinator = pstrain.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        net = Net(200_000, dim=16)  # 12.8 MB of table
        remote = ptorch.RemoteModule(net)
        opt = pstrain.optimizers.Adagrad(0.1)
    await strategy.flush()
    rng = np.random.default_rng(2)
    teacher = rng.normal(size=200_000).astype(np.float32)

    def batch():
        ids = rng.integers(0, 2000, (64, 3))
        x = rng.normal(size=(64, 2)).astype(np.float32)
        y = np.tanh(teacher[ids].sum(1) / 3 + x[:, 0]).astype(np.float32)
        return ids, torch.from_numpy(x), torch.from_numpy(y)

    step = mse_step(net, remote, opt)

    def traffic():
        return sum(s[1] + s[2] for server in cluster.ps for s in server.stats.values())

    first = await coordinator.schedule(step, args=batch())
    start = traffic()
    losses = [coordinator.schedule(step, args=batch()) for _ in range(300)]
    await coordinator.join()
    per_step = (traffic() - start) / 300
    assert per_step < 40_000, per_step  # 192 ids x 16 floats each way, not the 12.8 MB table
    tail = np.mean([await r for r in losses[-30:]])
    assert tail < 0.6 * first, (first, tail)
    await coordinator.close()


def test_forward_needs_the_fetched_ids():
    net = Net(10)  # outside any scope: a local table, no cluster needed
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="pull"):
        net(np.zeros((2, 3), np.int64), torch.zeros(2, 2))
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="torch.nn.Module"):
        ptorch.RemoteModule(object())


async def test_steps_in_flight_together_each_use_a_replica(cluster):
    strategy = strategy_for(cluster)
    coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=4)
    torch.manual_seed(0)
    with strategy.scope():
        net = Net(100)
        remote = ptorch.RemoteModule(net)
        opt = pstrain.optimizers.SGD(0.01)
    rng = np.random.default_rng(4)

    async def step(ids, x, y):
        async with remote.replica({net.emb: ids}) as model:  # the Embedding, or its name "emb"
            loss = torch.mean((model(ids, x) - y) ** 2)
            loss.backward()
            grads = remote.gradients(model)
        await opt.apply_gradients(grads)
        return len(grads)

    rvs = [
        coordinator.schedule(step, args=(rng.integers(0, 100, (8, 3)), torch.randn(8, 2), torch.randn(8)))
        for _ in range(40)
    ]
    await coordinator.join()
    assert {await r for r in rvs} == {3}  # fc.weight, fc.bias and the embedding rows, every time
    assert await opt.iterations.numpy() == 40
    await coordinator.close()


@pytest.mark.parametrize("scale", [False, True])
async def test_padding_idx_and_scale_grad_by_freq_as_nn_embedding(cluster, scale):
    """``nn.Embedding(padding_idx=0, scale_grad_by_freq=...)``'s outputs and table gradient
    (its padding row zeros, as a new one's), against pstrain's Embedding on the ps."""
    strategy = strategy_for(cluster)
    with strategy.scope():
        emb = ptorch.Embedding(
            12,
            3,
            pstrain.initializers.RandomNormal(0.0, 1.0, seed=4),
            padding_idx=0,
            scale_grad_by_freq=scale,
        )
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 12, (5, 4))
    ids[0, :2] = 0  # the padding id, twice
    ids[2] = 7  # an id four times
    upstream = torch.from_numpy(rng.normal(size=(5, 4, 3)).astype(np.float32))
    table = await emb.table.numpy()
    ref = torch.nn.Embedding(12, 3, padding_idx=0, scale_grad_by_freq=scale)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(table))
        ref.weight[0] = 0  # (nn.Embedding makes its padding row zeros)
    want = ref(torch.from_numpy(ids))
    (want * upstream).sum().backward()
    await emb.fetch(ids)
    out = emb(ids)
    (out * upstream).sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(), rtol=1e-6)
    grad, var = emb.gradient()
    assert var is emb.table and 0 not in grad.indices.tolist()
    dense = np.zeros((12, 3), np.float32)
    dense[grad.indices] = grad.values
    np.testing.assert_allclose(dense, ref.weight.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_an_embeddings_max_norm_and_a_padding_idx_past_its_rows_are_refused():
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="max_norm is not supported"):
        ptorch.Embedding(10, 2, max_norm=1.0)
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match=r"padding_idx must be within num_embeddings \(10\)"
    ):
        ptorch.Embedding(10, 2, padding_idx=10)
    assert ptorch.Embedding(10, 2, padding_idx=-1).padding_idx == 9  # from the end, as PyTorch


async def test_an_embedding_fetched_for_two_steps_gives_each_its_own_rows(cluster):
    """Two steps on one worker without replicas: the second fetches its ids before the
    first's forward pass; each forward gives its own ids' rows, each gradient its own ids."""
    with strategy_for(cluster).scope():
        emb = ptorch.Embedding(20, 2, pstrain.initializers.RandomNormal(0.0, 1.0, seed=2))
    table = await emb.table.numpy()
    first, second = np.array([[1, 2], [2, 3]]), np.array([[15, 19]])
    await emb.fetch(first)
    await emb.fetch(second)
    for ids, want_ids in ((first, [1, 2, 3]), (second, [15, 19])):
        out = emb(torch.from_numpy(ids))
        np.testing.assert_array_equal(out.detach().numpy(), table[ids])
        out.sum().backward()
        grad, _ = emb.gradient()
        assert grad.indices.tolist() == want_ids
        assert emb.rows.shape == (len(want_ids), 2)
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="other ids than were fetched"):
        emb(np.array([[4, 5]]))
