"""A worker's training steps read what its earlier steps wrote, with several closures in
flight (``_training/step_order.py``), on real ps and workers in this process."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pstrain
from pstrain import EmbeddingCollection, JaggedTensor, TableConfig
from pstrain.testing import InProcessCluster
from tests.helpers import strategy_for

pytestmark = pytest.mark.timeout(90)

ROW0 = {"f": JaggedTensor.from_lists([[0]])}


def counter_collection() -> EmbeddingCollection:
    """One table whose row 0 counts the steps: SGD(1) with a gradient of -1 adds 1."""
    return EmbeddingCollection([TableConfig("t", 4, 1, ["f"], initializer=pstrain.initializers.Zeros())])


async def test_steps_in_flight_on_a_worker_each_read_the_previous_steps_update():
    async with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        async with strategy.scope():
            collection = counter_collection()
            sgd = pstrain.optimizers.SGD(1.0)

        async def step() -> float:
            pooled = await collection.lookup(ROW0)
            seen = float(pooled.concat()[0, 0])
            await collection.apply_gradients(pooled.gradients(-np.ones((1, 1), np.float32)), sgd)
            return seen

        steps = [coordinator.schedule(step) for _ in range(8)]
        await coordinator.join()
        seen = sorted([await rv for rv in steps])
        # unordered, two steps in flight read the same count (the other's lookup goes out
        # while this one's update travels); in order, each read the count the step before
        # it left
        assert seen == [float(i) for i in range(8)]
        assert float((await collection.tables["t"].numpy())[0, 0]) == 8.0
        await coordinator.close()


async def test_a_step_that_fails_or_never_updates_does_not_hold_the_next(ps_server):
    async with strategy_for(ps_server).scope():
        collection = counter_collection()

    async def fails() -> None:
        await collection.lookup(ROW0)
        raise RuntimeError("the step's compute failed")

    async def reads_only() -> float:
        return float((await collection.lookup(ROW0)).concat()[0, 0])

    task = asyncio.create_task(fails())
    with pytest.raises(RuntimeError, match="compute failed"):
        await task
    assert await asyncio.wait_for(asyncio.create_task(reads_only()), 30) == 0.0
    assert await asyncio.wait_for(asyncio.create_task(reads_only()), 30) == 0.0


async def test_evaluation_waits_for_no_step_and_a_training_read_waits_for_the_update(ps_server):
    async with strategy_for(ps_server).scope():
        collection = counter_collection()
        sgd = pstrain.optimizers.SGD(1.0)
    go_on = asyncio.Event()

    async def holds_its_place() -> None:
        pooled = await collection.lookup(ROW0)
        await go_on.wait()
        await collection.apply_gradients(pooled.gradients(-np.ones((1, 1), np.float32)), sgd)

    holder = asyncio.create_task(holds_its_place())
    # (the holder takes its place when it first runs, before its read is sent: while this
    # evaluation's request travels)
    probe = await asyncio.wait_for(collection.lookup(ROW0, training=False), 30)
    assert float(probe.concat()[0, 0]) == 0.0 and not holder.done()
    training = asyncio.create_task(collection.lookup(ROW0))
    # evaluation goes on while a training read waits in line
    evaluated = await asyncio.wait_for(collection.lookup(ROW0, training=False), 30)
    assert float(evaluated.concat()[0, 0]) == 0.0
    go_on.set()
    await asyncio.wait_for(holder, 30)
    after = await asyncio.wait_for(training, 30)
    assert float(after.concat()[0, 0]) == 1.0  # read after the update it waited for


async def test_a_step_that_reads_twice_or_runs_several_steps_never_waits_on_itself(ps_server):
    """A two-tower step reads twice before its update (also from tasks it starts); a task
    that runs several steps takes a new place for each (and reads each one's update)."""
    async with strategy_for(ps_server).scope():
        collection = counter_collection()
        sgd = pstrain.optimizers.SGD(1.0)
    one = -np.ones((1, 1), np.float32)

    async def two_towers() -> list[float]:
        first = await collection.lookup(ROW0)
        second, third = await asyncio.gather(collection.lookup(ROW0), collection.lookup(ROW0))
        await collection.apply_gradients(first.gradients(one), sgd)
        return [float(p.concat()[0, 0]) for p in (first, second, third)]

    async def several_steps(n: int) -> list[float]:
        seen = []
        for _ in range(n):
            pooled = await collection.lookup(ROW0)
            seen.append(float(pooled.concat()[0, 0]))
            await collection.apply_gradients(pooled.gradients(one), sgd)
        return seen

    assert await asyncio.wait_for(asyncio.create_task(two_towers()), 30) == [0.0, 0.0, 0.0]
    assert await asyncio.wait_for(asyncio.create_task(several_steps(3)), 30) == [1.0, 2.0, 3.0]
    # and in this test's own task, step after step
    assert await asyncio.wait_for(several_steps(2), 30) == [4.0, 5.0]


async def test_tables_with_optimizers_of_their_own_are_read_after_every_update():
    """Two tables, each with its own optimizer (Adam's counting its step first): the next
    step on the worker reads after the update of both."""
    async with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        zeros = pstrain.initializers.Zeros()
        async with strategy.scope():
            collection = EmbeddingCollection(
                [
                    TableConfig("a", 4, 1, ["a"], initializer=zeros, optimizer=pstrain.optimizers.SGD(1.0)),
                    TableConfig("b", 4, 1, ["b"], initializer=zeros, optimizer=pstrain.optimizers.Adam(1.0)),
                ]
            )
        batch = {"a": JaggedTensor.from_lists([[0]]), "b": JaggedTensor.from_lists([[0]])}

        async def step() -> tuple[float, float]:
            pooled = await collection.lookup(batch)
            seen = pooled.concat()[0]
            await collection.apply_gradients(pooled.gradients(-np.ones((1, 2), np.float32)))
            return float(seen[0]), float(seen[1])

        steps = [coordinator.schedule(step) for _ in range(8)]
        await coordinator.join()
        seen = sorted([await rv for rv in steps])
        # Adam's step on a constant gradient is its learning rate (to within epsilon)
        np.testing.assert_allclose(seen, [(i, i) for i in range(8)], atol=1e-4)
        await coordinator.close()
