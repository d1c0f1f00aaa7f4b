"""A ps decodes a ``vars/call`` (``strategy.extended.update``) whose pickles import a
module it has not imported yet (torch's first import takes seconds) on a thread: it
answers health checks and serves other requests meanwhile, then runs the function on its
loop, in one step, as before. Real processes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import pstrain
from pstrain import rpc

from .slow_import import slow_import

pytestmark = pytest.mark.timeout(60)


def _add_value(array, payload):
    array += payload.value
    return float(array.sum())


async def _sum_of(v):
    return float((await v.read_value()).sum())


async def test_a_function_whose_unpickling_imports_a_slow_module_does_not_stall_the_ps(tmp_path):
    async with slow_import(tmp_path) as slow:
        timeout_s = 2.0
        async with pstrain.LocalCluster(num_ps=1, num_workers=1, env=slow.env) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            coordinator = pstrain.ClusterCoordinator(strategy, ps_timeout_s=timeout_s, heartbeat_s=0.25)
            async with strategy.scope():
                v = pstrain.Variable(np.zeros(3, np.float32), name="v")
            update = asyncio.ensure_future(
                strategy.extended.update(v, _add_value, args=(slow.module.Payload(41.0),))
            )
            await asyncio.wait_for(slow.started.wait(), 30)  # the ps imports the argument's module
            importing_since = time.monotonic()
            ch = rpc.Channel(
                cluster.cluster_spec.as_dict()["ps"][0],
                token=cluster.resolver.token,
                task="/job:ps/replica:0/task:0",
            )
            try:
                # while it imports, for twice the coordinator's ps deadline, the update does
                # not run, and the ps answers health checks and a worker's closure's read
                while time.monotonic() - importing_since < 2 * timeout_s:
                    done, _ = await asyncio.wait({update}, timeout=0.2)
                    assert not done, "the update ran before its argument's module was imported"
                    await asyncio.wait_for(ch.health(), 1.0)
                    assert await asyncio.wait_for(coordinator.schedule(_sum_of, args=(v,)).get(), 2.0) == 0.0
            finally:
                await ch.close()
            slow.release()
            assert await update == 123.0
            np.testing.assert_array_equal(await v.read_value(), np.full(3, 41.0, np.float32))
            await coordinator.join()
            assert coordinator.worker_failures == 0, coordinator.membership()
            await coordinator.close()
