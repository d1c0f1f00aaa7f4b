"""A worker whose closures or arguments import slow modules is not declared lost."""

from __future__ import annotations

import asyncio
import time

import pytest

import pstrain
from pstrain import rpc

from .slow_import import slow_import

pytestmark = pytest.mark.timeout(60)


class _SlowToLoad:
    """Unpickles as ``time.sleep(seconds)``: the behaviour under test is a load that takes
    seconds (torch's first import on a busy machine), in another process."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        return (time.sleep, (self.seconds,))


def _slow_to_load(seconds: float):
    slow = _SlowToLoad(seconds)

    def answer(x):
        assert slow is None  # what time.sleep returned, at its unpickling
        return x + 1

    return answer


async def test_a_worker_loading_a_slow_function_for_its_first_closure_is_not_declared_lost():
    """A closure's function is unpickled (its modules imported) on a thread: the worker
    answers health checks meanwhile, and the coordinator declares nothing lost."""
    async with pstrain.LocalCluster(num_ps=1, num_workers=1) as cluster:
        coordinator = pstrain.ClusterCoordinator(
            pstrain.ParameterServerStrategy(cluster.resolver), worker_timeout_s=2.0, heartbeat_s=0.25
        )
        started = time.monotonic()
        assert await coordinator.schedule(_slow_to_load(5.0), args=(41,)) == 42
        assert time.monotonic() - started >= 5.0  # it did load slowly
        assert coordinator.worker_failures == 0, coordinator.membership()
        await coordinator.close()


def _value_plus_one(payload):
    return payload.value + 1


async def test_an_argument_whose_unpickling_imports_a_slow_module_does_not_lose_the_worker(tmp_path):
    """A closure's *argument* may name a module the worker has not imported (a torch
    tensor): the worker decodes that request on a thread and answers health checks while
    the import runs, longer than the coordinator's health deadline; nothing is lost."""
    async with slow_import(tmp_path) as slow:
        timeout_s = 2.0
        async with pstrain.LocalCluster(num_ps=1, num_workers=1, env=slow.env) as cluster:
            coordinator = pstrain.ClusterCoordinator(
                pstrain.ParameterServerStrategy(cluster.resolver),
                worker_timeout_s=timeout_s,
                heartbeat_s=0.25,
            )
            rv = coordinator.schedule(_value_plus_one, args=(slow.module.Payload(41),))
            await asyncio.wait_for(slow.started.wait(), 30)  # the worker imports the argument's module
            importing_since = time.monotonic()
            ch = rpc.Channel(
                cluster.cluster_spec.as_dict()["worker"][0],
                token=cluster.resolver.token,
                task="/job:worker/replica:0/task:0",
            )
            result = asyncio.ensure_future(rv.get())
            try:
                # while it imports, for twice the coordinator's deadline, the closure does not
                # end and the worker answers health checks, each within a second
                while time.monotonic() - importing_since < 2 * timeout_s:
                    done, _ = await asyncio.wait({result}, timeout=0.2)
                    assert not done, "the closure ended before its argument's import did"
                    await asyncio.wait_for(ch.health(), 1.0)
            finally:
                await ch.close()
            slow.release()
            assert await result == 42
            assert coordinator.worker_failures == 0, coordinator.membership()
            await coordinator.close()
