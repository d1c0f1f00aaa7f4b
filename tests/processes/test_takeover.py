"""Several strategies and coordinators against the same ps: a second strategy creates its own
variables, a new coordinator takes over a dead one's, and a ps that restarts (even at once)
is reported as UnavailableError with its new incarnation."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pstrain
from pstrain._formats.messages.operations import ListVariables
from pstrain.checkpoint import Checkpoint
from pstrain.errors import AlreadyExistsError, UnavailableError
from pstrain.rpc import Channel
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, strategy_for, wait_for

pytestmark = pytest.mark.timeout(90)


async def _ps_keys(ps):
    channel = Channel(ps.address, token=TOKEN, task="ps0")
    try:
        return {v.name for v in (await channel.request(ListVariables())).variables}
    finally:
        await channel.close()


async def test_a_second_live_strategy_creates_its_own_variables(ps_server):
    first = strategy_for(ps_server)
    async with first.scope():
        w1 = pstrain.Variable(np.ones(2, np.float32))
    second = strategy_for(ps_server)  # a notebook cell run again, the first still alive
    async with second.scope():
        w2 = pstrain.Variable(np.full(2, 7.0, np.float32))
    assert w1.name == w2.name == "Variable"  # as TF shows them
    assert (await w1.numpy()).tolist() == [1, 1] and (await w2.numpy()).tolist() == [7, 7]
    assert await _ps_keys(ps_server) == {"Variable", "strategy_1/Variable"}
    # an optimizer of the second strategy trains the second's variables only
    async with second.scope():
        opt = pstrain.optimizers.SGD(1.0)
    await opt.apply_gradients([(np.ones(2), w2)])
    assert (await w2.numpy()).tolist() == [6, 6] and (await w1.numpy()).tolist() == [1, 1]


async def test_a_new_coordinator_takes_over_a_dead_ones_variables_and_slots(ps_server, caplog):
    old = strategy_for(ps_server)
    async with old.scope():
        table = pstrain.Variable(np.zeros((4, 2), np.float32), name="emb")
        opt = pstrain.optimizers.Adagrad(1.0, initial_accumulator_value=0.0)
    await opt.apply_gradients([(np.ones((4, 2)), table)])  # a slot on the ps
    del old, table, opt
    gc.collect()  # the old coordinator is gone (a killed chief)
    new = strategy_for(ps_server)
    async with new.scope():  # same names, a new owner: replaced, not AlreadyExistsError
        table = pstrain.Variable(np.full((4, 2), 5.0, np.float32), name="emb")
        opt = pstrain.optimizers.Adagrad(1.0, initial_accumulator_value=0.0)
    assert "taken over by a new coordinator" in caplog.text
    assert (await table.numpy()).tolist() == [[5, 5]] * 4
    assert await opt.iterations.numpy() == 0
    await opt.apply_gradients([(np.full((4, 2), 2.0), table)])
    # the dead one's accumulator (1.0) was dropped with its variable: a fresh one gives 5 - 1
    np.testing.assert_allclose(await table.numpy(), np.full((4, 2), 4.0), rtol=1e-6)
    # the same owner creating the same key again is still a true duplicate
    channel = Channel(ps_server.address, token=TOKEN, task="ps0")
    spec = {"name": "emb", "dtype": "<f4", "shape": [4, 2], "value": np.zeros((4, 2), np.float32)}
    with pytest.raises(AlreadyExistsError):
        await untyped_call(channel, "vars/create", {"vars": [spec], "owner": new.placement.owner})
    with pytest.raises(AlreadyExistsError):
        await untyped_call(channel, "vars/create", {"vars": [spec]})  # no owner: no takeover
    await channel.close()


@pytest.mark.parametrize("idle", [False, True], ids=["busy", "idle"])
async def test_a_ps_that_restarts_at_once_is_reported_and_a_restore_continues(tmp_path, idle, drill):
    cluster = await drill.cluster(num_ps=2, num_workers=1, checkpoint_root=tmp_path)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, heartbeat_s=0.2 if idle else 60.0)
    async with strategy.scope():
        a = pstrain.Variable(np.zeros(2, np.float32), name="a")  # ps 0
        b = pstrain.Variable(np.zeros(2, np.float32), name="b")  # ps 1

    async def step():
        await a.assign_add(np.ones(2, np.float32))
        await b.assign_add(np.ones(2, np.float32))

    coordinator.schedule(step)
    await coordinator.join()
    await wait_for(lambda: all(coordinator.ps_incarnations), what="the first heartbeat")
    path = await Checkpoint(a=a, b=b).save(str(tmp_path / "ckpt"))
    await cluster.restart("ps", 1)  # back on the same port, its variables gone
    if idle:  # the heartbeat notices with nothing running; the next join reports it
        with pytest.raises(UnavailableError, match="restarted") as info:
            await wait_for(lambda: coordinator.done() and False, timeout=20, what="the report")
    else:  # the closure finds b missing; join says why
        coordinator.schedule(step)
        with pytest.raises(UnavailableError, match="restarted") as info:
            await coordinator.join()
    assert info.value.task == "/job:ps/replica:0/task:1"
    assert "restore the latest checkpoint" in str(info.value)
    (await Checkpoint(a=a, b=b).restore(path)).assert_consumed()
    coordinator.schedule(step)
    await coordinator.join()
    assert (await b.numpy()).tolist() == [2, 2]
    await coordinator.close()


async def test_a_ps_lost_before_creations_go_out_is_not_a_worker_failure(caplog, drill):
    cluster = await drill.cluster(num_ps=2, num_workers=1)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, heartbeat_s=60.0)
    # A ps never reached may still be starting: creations wait for it (60 s by default).
    strategy.placement.startup_timeout_s = 2.0
    with strategy.scope():  # queued, not sent yet
        a = pstrain.Variable(np.zeros(2, np.float32), name="a")  # ps 0
        b = pstrain.Variable(np.zeros(2, np.float32), name="b")  # ps 1
    await cluster.kill("ps", 1)
    coordinator.schedule(lambda: 1)  # the dispatcher sends the creations first
    with pytest.raises(UnavailableError) as info:
        await coordinator.join()
    assert info.value.task == "/job:ps/replica:0/task:1"
    assert coordinator.worker_failures == 0
    assert not [r for r in caplog.records if "worker" in r.getMessage() and "unreachable" in r.getMessage()]
    assert a.name == "a" and b.name == "b"
    await coordinator.close()
