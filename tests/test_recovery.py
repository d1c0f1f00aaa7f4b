"""Recovery that composes: fences belong to a coordinator incarnation, checkpoints of
framework models key parameters by path, evaluation changes no table, datasets end as
in TF. Each test is a finding of the recovery issue and failed before its fix."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import pstrain
from pstrain.errors import CancelledError
from pstrain.rpc import Channel

from .conftest import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(90)


async def _update(channel: Channel, owner: str, worker: int, epoch: int) -> None:
    await channel.call("vars/assign_add", {"name": "v", "value": np.ones(2, np.float32),
                                           "owner": owner, "fence": [worker, epoch]})


async def test_a_fence_of_an_old_coordinator_never_refuses_a_new_one(ps_server):
    channel = Channel(ps_server.address, token=TOKEN, task="ps0")
    try:
        spec = {"name": "v", "dtype": "<f4", "shape": [2], "value": np.zeros(2, np.float32)}
        await channel.call("vars/create", {"vars": [spec], "owner": "old"})
        # the old coordinator lost worker 1 once: its dispatch 1 is fenced off
        await channel.call("ps/fence", {"worker": 1, "epoch": 2, "owner": "old"})
        with pytest.raises(CancelledError, match="declared that worker lost"):
            await _update(channel, "old", 1, 1)
        # a new coordinator takes the ps over; its worker 1 starts at dispatch 1 again
        await channel.call("vars/create", {"vars": [spec], "owner": "new"})
        await _update(channel, "new", 1, 1)
        # ... and the old one, a zombie still running, can never write again
        with pytest.raises(CancelledError, match="newer coordinator took this ps over"):
            await _update(channel, "old", 1, 2)
        with pytest.raises(CancelledError, match="newer coordinator"):
            await channel.call("vars/assign", {"name": "v", "value": np.zeros(2, np.float32),
                                               "owner": "old"})
        with pytest.raises(CancelledError, match="newer coordinator"):
            await channel.call("ps/fence", {"worker": 0, "epoch": 9, "owner": "old"})
        value = (await channel.call("vars/read", {"names": ["v"]}))["values"][0]
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
