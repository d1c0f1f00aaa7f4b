"""Recovery that composes: fences belong to a coordinator incarnation, checkpoints of
framework models key parameters by path, evaluation changes no table, datasets end as
in TF. Each test is a finding of the recovery issue and failed before its fix."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import pstrain
import pstrain.jax as pjax
import pstrain.torch as ptorch
from pstrain._base.tags import set_dispatch
from pstrain._formats.messages.operations import ReadVariables
from pstrain.data import Dataset
from pstrain.errors import CancelledError
from pstrain.partitioners import FixedShardsPartitioner
from pstrain.rpc import Channel
from pstrain.server import ParameterServer
from pstrain.testing import InProcessCluster, untyped_call
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(90)


async def _update(channel: Channel, owner: str, worker: int, epoch: int) -> None:
    await untyped_call(
        channel,
        "vars/assign_add",
        {"name": "v", "value": np.ones(2, np.float32), "owner": owner, "fence": [worker, epoch]},
    )


async def test_a_fence_of_an_old_coordinator_never_refuses_a_new_one(ps_server):
    channel = Channel(ps_server.address, token=TOKEN, task="ps0")
    try:
        spec = {"name": "v", "dtype": "<f4", "shape": [2], "value": np.zeros(2, np.float32)}
        await untyped_call(channel, "vars/create", {"vars": [spec], "owner": "old"})
        # the old coordinator lost worker 1 once: its dispatch 1 is fenced off
        await untyped_call(channel, "ps/fence", {"worker": 1, "epoch": 2, "owner": "old"})
        with pytest.raises(CancelledError, match="declared that worker lost"):
            await _update(channel, "old", 1, 1)
        # a new coordinator takes the ps over; its worker 1 starts at dispatch 1 again
        await untyped_call(channel, "vars/create", {"vars": [spec], "owner": "new"})
        await _update(channel, "new", 1, 1)
        # ... and the old one, a zombie still running, can never write again
        with pytest.raises(CancelledError, match="newer coordinator took this ps over"):
            await _update(channel, "old", 1, 2)
        with pytest.raises(CancelledError, match="newer coordinator"):
            await untyped_call(
                channel, "vars/assign", {"name": "v", "value": np.zeros(2, np.float32), "owner": "old"}
            )
        with pytest.raises(CancelledError, match="newer coordinator"):
            await untyped_call(channel, "ps/fence", {"worker": 0, "epoch": 9, "owner": "old"})
        value = (await channel.request(ReadVariables(names=["v"]))).values[0]
        assert value.tolist() == [1, 1]  # the new coordinator's update alone
    finally:
        await channel.close()


async def test_a_strategy_taken_over_cannot_write_through_its_handles(ps_server):
    old = strategy_for(ps_server)
    async with old.scope():
        v_old = pstrain.Variable(np.zeros(2, np.float32), name="v")
    new = strategy_for(ps_server)
    new.placement.namespace = ""  # a restarted coordinator: the same keys as the dead one
    async with new.scope():
        v_new = pstrain.Variable(np.full(2, 3.0, np.float32), name="v")
    with pytest.raises(CancelledError, match="newer coordinator"):
        await v_old.assign_add(np.ones(2, np.float32))
    await v_new.assign_add(np.ones(2, np.float32))
    assert (await v_new.numpy()).tolist() == [4, 4]
    del old, v_old
    gc.collect()


async def test_a_zombie_coordinator_restores_creates_and_maps_nothing_over_a_new_one(ps_server, tmp_path):
    """A coordinator taken over (a zombie still running) cannot restore its checkpoint over
    the new one's variables, nor admit rows into its tables by training lookups, nor take
    the ps back by creating variables or tables of the same names again (its optimizer's
    slots, say), nor send the ps a map."""
    old = strategy_for(ps_server)
    async with old.scope():
        v_old = pstrain.Variable(np.zeros(2, np.float32), name="v")
        t_old = pstrain.DynamicEmbedding(2, name="t")
    await t_old.lookup(np.array([1]))
    path = await pstrain.Checkpoint(v=v_old).save(str(tmp_path / "old"))
    new = strategy_for(ps_server)
    new.placement.namespace = ""  # a restarted coordinator: the same keys as the dead one
    async with new.scope():
        v_new = pstrain.Variable(np.full(2, 3.0, np.float32), name="v")
        t_new = pstrain.DynamicEmbedding(2, name="t")
    await t_new.lookup(np.array([5]))
    with pytest.raises(CancelledError, match="newer coordinator"):
        await pstrain.Checkpoint(v=v_old).restore(path)
    with pytest.raises(CancelledError, match="newer coordinator"):  # it would admit rows
        await t_old.lookup(np.array([7, 8]))
    assert len(ps_server.tables["t"]) == 1
    channel = Channel(ps_server.address, token=TOKEN, task="/job:ps/replica:0/task:0")
    channel.session.owner = owner = old.placement.owner
    try:
        spec = {"name": "v", "dtype": "<f4", "shape": [2], "value": np.zeros(2, np.float32)}
        with pytest.raises(CancelledError, match="newer coordinator"):
            await untyped_call(channel, "vars/create", {"vars": [spec], "owner": owner})
        with pytest.raises(CancelledError, match="newer coordinator"):
            await untyped_call(channel, "dyn/create", {"name": "t", "config": {"dim": 2}, "owner": owner})
        placement = (await untyped_call(channel, "ps/placement/read", {}))["placement"]
        with pytest.raises(CancelledError, match="newer coordinator"):
            await untyped_call(channel, "ps/placement", {"placement": {**placement, "version": 99}})
    finally:
        await channel.close()
    await v_new.assign_add(np.ones(2, np.float32))  # the new coordinator still owns the ps
    assert (await v_new.numpy()).tolist() == [4, 4]
    assert len(await t_new.lookup(np.array([5, 6]))) == 2
    assert ps_server.tables["t"].owner == new.placement.owner
    del old, v_old, t_old
    gc.collect()


# -- framework models in checkpoints, by path -------------------------------------------------------
torch = pytest.importorskip("torch")  # an extra of the dev install: always present in make test


def _towers(first: str) -> torch.nn.Module:
    """Two same-shaped layers, declared in either order: position must not decide."""
    torch.manual_seed(0 if first == "user" else 1)
    net = torch.nn.Module()
    order = ["user", "item"] if first == "user" else ["item", "user"]
    for name in order:
        setattr(net, name, torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    return net


@pytest.mark.parametrize("give", ["module", "remote"])
async def test_a_pytorch_model_restores_by_parameter_path_not_position(cluster, tmp_path, give):

    saved_strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with saved_strategy.scope():
        net = _towers("user")
        remote = ptorch.RemoteModule(net)
    ckpt = pstrain.Checkpoint(model=net if give == "module" else remote)
    path = await ckpt.write(str(tmp_path / "towers"))
    keys = set(pstrain.checkpoint.load_variables(path))
    assert {"model/user/0/weight", "model/item/0/bias"} <= keys
    assert not any("variables" in k for k in keys)  # never by position
    want = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        other = _towers("item")  # the other order, other initial values
        other_remote = ptorch.RemoteModule(other)
    status = await pstrain.Checkpoint(model=other if give == "module" else other_remote).restore(path)
    status.assert_consumed()
    await other_remote.pull()
    for name, param in other.named_parameters():
        np.testing.assert_array_equal(param.detach().numpy(), want[name], err_msg=name)


async def test_a_checkpoint_refuses_what_it_cannot_track(cluster):
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="RemoteModule"):
        pstrain.Checkpoint(model=torch.nn.Linear(2, 2))  # its weights are not on the ps
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="cannot track"):
        pstrain.Checkpoint(step=5)
    ckpt = pstrain.Checkpoint(model={})
    with pytest.raises(pstrain.errors.InvalidArgumentError):
        ckpt.model = object()  # refused at attach too, and nothing changed
    assert ckpt.model == {}


async def test_assert_consumed_fails_when_nothing_was_tracked(cluster, tmp_path):
    pstrain.ParameterServerStrategy(cluster.resolver)
    path = await pstrain.Checkpoint(model={}).write(str(tmp_path / "empty"))  # saved nothing
    status = await pstrain.Checkpoint(model={}).restore(path)
    with pytest.raises(AssertionError, match="tracks no variable"):
        status.assert_consumed()


async def test_an_equinox_model_restores_by_field_path(cluster, tmp_path):
    eqx = pytest.importorskip("equinox")
    import jax

    class AB(eqx.Module):
        a: jax.Array
        b: jax.Array

    class BA(eqx.Module):  # the same fields, declared the other way round
        b: jax.Array
        a: jax.Array

    first = pstrain.ParameterServerStrategy(cluster.resolver)
    with first.scope():
        model = pjax.variables_from(AB(a=np.full(3, 1.0, np.float32), b=np.full(3, 2.0, np.float32)))
    path = await pstrain.Checkpoint(model=model).write(str(tmp_path / "eqx"))
    second = pstrain.ParameterServerStrategy(cluster.resolver)
    with second.scope():
        other = pjax.variables_from(BA(b=np.zeros(3, np.float32), a=np.zeros(3, np.float32)))
    (await pstrain.Checkpoint(model=other).restore(path)).assert_consumed()
    assert (await other.a.numpy()).tolist() == [1, 1, 1]
    assert (await other.b.numpy()).tolist() == [2, 2, 2]


# -- adapters: evaluation changes nothing; a table looked up twice has one gradient ---------------
async def test_evaluation_through_every_adapter_admits_no_row(cluster):

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(4, name="items", capacity=1000)
        net = torch.nn.Module()
        net.emb = ptorch.Embedding(None, 4, table=table)
        remote = ptorch.RemoteModule(net)
    held_out = np.arange(1000, 1050, dtype=np.int64)
    await remote.pull({net.emb: held_out}, training=False)
    async with remote.replica({"emb": held_out}, training=False):
        pass
    await net.emb.fetch(held_out, training=False)
    await pstrain.embedding_lookup(table, held_out, training=False)
    grad_fn = pjax.value_and_grad(lambda p: (p["e"] ** 2).sum())
    await grad_fn({"e": pjax.lookup(table, held_out, training=False)})
    assert await table.size() == 0  # evaluation admitted nothing
    await remote.pull({net.emb: held_out[:3]})  # training admits
    assert await table.size() == 3


async def test_a_jax_model_looking_a_table_up_twice_gets_one_gradient(cluster):

    strategy = pstrain.ParameterServerStrategy(
        cluster.resolver, variable_partitioner=FixedShardsPartitioner(2)
    )
    with strategy.scope():
        items = pstrain.Variable(np.ones((6, 2), np.float32), name="items")
        opt = pstrain.optimizers.SGD(1.0)

    def loss(p):  # a shared embedding: the query and the candidate read the same table
        return (p["query"] * p["candidate"]).sum()

    grad_fn = pjax.value_and_grad(loss)
    _, grads = await grad_fn({"query": pjax.lookup(items, [0, 4]), "candidate": pjax.lookup(items, [4, 5])})
    assert len(grads) == 1
    await opt.apply_gradients(grads)
    # d/d row: row 0 gets candidate row 4 (1), row 4 gets both partners (2), row 5 gets row 4 (1)
    np.testing.assert_allclose((await items.numpy())[:, 0], [0, 1, 1, 1, -1, 0])


@pytest.mark.parametrize("capacity", [0, -5, 1, 2.5, True])
async def test_a_dynamic_table_capacity_is_checked_before_anything(cluster, capacity):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)  # two ps
    with strategy.scope(), pytest.raises(pstrain.errors.InvalidArgumentError, match="capacity"):
        pstrain.DynamicEmbedding(4, capacity=capacity)


async def test_a_dynamic_table_holds_exactly_its_capacity_in_all(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(2, capacity=7)
    for start in range(0, 400, 100):
        await pstrain.embedding_lookup(table, np.arange(start, start + 100))
    assert await table.size() == 7


# -- datasets end as in TF --------------------------------------------------------------------
async def test_an_exhausted_dataset_consumes_every_batch_then_raises_out_of_range(cluster):

    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def four_batches():
        return Dataset.range(4)

    it = iter(coordinator.create_per_worker_dataset(four_batches))

    async def step(it):  # async: a StopIteration would become "coroutine raised StopIteration"
        return next(it)

    rvs = [coordinator.schedule(step, args=(it,)) for _ in range(10)]
    with pytest.raises(pstrain.errors.OutOfRangeError, match=r"four_batches.*\.repeat\(\)"):
        await coordinator.join()
    got, ends = [], 0
    for rv in rvs:
        try:
            got.append(int(await rv))
        except pstrain.errors.OutOfRangeError:
            ends += 1
        except pstrain.errors.CancelledError:
            pass
    assert sorted(got) == [0, 0, 1, 1, 2, 2, 3, 3]  # both workers' batches, every one
    assert ends == 1
    # the coordinator carries on: a new iterator starts from the beginning on every worker
    again = iter(coordinator.create_per_worker_dataset(four_batches))
    assert int(await coordinator.schedule(step, args=(again,))) == 0
    await coordinator.close()


async def test_a_save_that_died_before_its_index_does_not_block_the_next_one(ps_server, tmp_path):

    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(np.ones(3, np.float32), name="v")
    ckpt = pstrain.Checkpoint(v=v)
    prefix = str(tmp_path / "ckpt-50")
    await ckpt.write(prefix)
    os.remove(prefix + ".index.json")  # the coordinator died after the ps wrote their parts
    await v.assign(np.full(3, 2.0, np.float32))
    await ckpt.write(prefix)  # the restarted job reaches step 50 again: it saves there again
    assert pstrain.checkpoint.load_variables(prefix)["v"].tolist() == [2, 2, 2]
    with pytest.raises(pstrain.errors.AlreadyExistsError, match="never written over"):
        await ckpt.write(prefix)  # a complete checkpoint is never written over


async def test_a_restore_fences_a_lost_workers_old_dispatch_again_on_a_ps_that_restarted(tmp_path):
    """The fault matrix's torch worker_kill+ps_kill, under load: worker 0, busy, is declared
    lost with a dispatch in flight (fenced off every ps); then ps 1 restarts empty (its
    fences gone) and the job restores the checkpoint. The old dispatch, still running, must
    be refused by the new ps 1 as by ps 0, not applied on top of the restored values."""

    root = str(tmp_path)
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
        )
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            a = pstrain.Variable(np.zeros(3, np.float32), name="a")  # on ps 0
            b = pstrain.Variable(np.zeros(3, np.float32), name="b")  # on ps 1
            table = pstrain.DynamicEmbedding(2, name="t", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        ids = np.arange(40, dtype=np.int64)
        await table.lookup(ids)
        ckpt = pstrain.Checkpoint(a=a, b=b, t=table)
        path = await ckpt.save(root + "/ckpt")
        owner = strategy.placement.owner
        await coordinator.workers.fence(0, 2)  # worker 0 lost: dispatch 1 is fenced off

        async def late_update() -> None:  # worker 0's dispatch 1, still running
            set_dispatch((owner, 0, 1), None)
            try:
                await b.assign_add(np.ones(3, np.float32))
            finally:
                set_dispatch(None, None)

        async def late_table_update() -> None:
            set_dispatch((owner, 0, 1), None)
            try:
                await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((40, 2), np.float32), ids), table)])
            finally:
                set_dispatch(None, None)

        with pytest.raises(CancelledError, match="declared that worker lost"):
            await late_update()
        host, port = cluster.ps[1].address.rsplit(":", 1)
        await cluster.ps[1].stop()  # ps 1 restarts, empty
        fresh = ParameterServer(1, host=host, port=int(port), token=cluster.token, checkpoint_root=root)
        await fresh.start()
        try:
            (await ckpt.restore(path)).assert_consumed()
            with pytest.raises(CancelledError, match="declared that worker lost"):
                await late_update()
            with pytest.raises(CancelledError, match="declared that worker lost"):
                await late_table_update()
            np.testing.assert_array_equal(await b.numpy(), np.zeros(3, np.float32))
            _, rows = await table.export()
            np.testing.assert_array_equal(rows, np.zeros((40, 2), np.float32))
            await b.assign_add(np.ones(3, np.float32))  # the coordinator's own update applies
            np.testing.assert_array_equal(await b.numpy(), np.ones(3, np.float32))
            await coordinator.close()
        finally:
            await fresh.stop()


async def test_a_for_loop_over_a_per_worker_iterator_ends_with_the_data_as_in_tf(cluster):
    """TF: ``for batch in iterator`` inside a closure ends the loop at the end of the data;
    ``next()`` at the end fails the closure with OutOfRangeError (sync and async alike)."""

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(lambda: Dataset.range(5))

    async def drain_async(it):
        return [int(x) for x in it]

    def drain_sync(it):
        return [int(x) for x in it]

    async def one_more(it):
        return next(it)

    for drain in (drain_async, drain_sync):
        it = iter(per_worker)
        drained = [await coordinator.schedule(drain, args=(it,)) for _ in range(4)]
        # a worker's first loop takes its five elements, its later loops find the end
        assert all(d in ([], [0, 1, 2, 3, 4]) for d in drained), drained
        assert 1 <= drained.count([0, 1, 2, 3, 4]) <= 2, drained

    async def drain_both(it, finished):
        # each worker drains its own iterator: this closure ends once the other worker's has
        # too, so (one closure at a time per worker) the two run on different workers
        out = [int(x) for x in it]
        await finished.assign_add(1)
        while int(await finished.read_value()) < 2:  # each read is a round trip to the ps
            pass
        return out

    with strategy.scope():
        finished = pstrain.Variable(0, dtype="int64", name="finished")
    it = iter(per_worker)
    both = [coordinator.schedule(drain_both, args=(it, finished)) for _ in range(2)]
    assert sorted([await rv for rv in both]) == [[0, 1, 2, 3, 4]] * 2
    coordinator.schedule(one_more, args=(it,))
    with pytest.raises(pstrain.errors.OutOfRangeError, match="End of sequence"):
        await coordinator.join()
    await coordinator.close()
