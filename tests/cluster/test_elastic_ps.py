"""Elastic parameter servers: a ps joins and leaves while training runs; variables move with
their optimizer slots and exactly-once records; a request sent by an old map is refused,
never applied to the wrong ps, and sent again by the client."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pstrain
from pstrain._base.tags import one_operation, set_dispatch
from pstrain._formats.messages.operations import AssignAdd
from pstrain._formats.messages.placement_map import EndMove, MoveOut
from pstrain.cli.common import join
from pstrain.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PlacementChangedError,
    ResourceExhaustedError,
    UnavailableError,
)
from pstrain.rpc import Channel
from pstrain.server import ParameterServer
from pstrain.testing import InProcessCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)

ROWS, DIM, STEPS = 4000, 8, 80


def _strategy(cluster: InProcessCluster) -> pstrain.ParameterServerStrategy:
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token),
        variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2),
    )


def _plain(cluster: InProcessCluster) -> tuple[pstrain.ParameterServerStrategy, pstrain.ClusterCoordinator]:
    """A strategy with no partitioner on ``cluster``, and its coordinator."""
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
    )
    return strategy, pstrain.ClusterCoordinator(strategy)


def _grads(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step ``step``'s gradients: whole numbers, so that any order of applying them sums to
    the same floats."""
    rng = np.random.default_rng(step)
    ids = rng.choice(ROWS, 64, replace=False)
    return (
        ids,
        rng.integers(-3, 4, (64, DIM)).astype(np.float32),
        rng.integers(-3, 4, (DIM,)).astype(np.float32),
    )


def _expected() -> tuple[np.ndarray, np.ndarray]:
    emb, dense = np.zeros((ROWS, DIM), np.float32), np.zeros(DIM, np.float32)
    for step in range(STEPS):
        ids, rows, d = _grads(step)
        emb[ids] -= rows
        dense -= d
    return emb, dense


def _held(ps: ParameterServer) -> set[str]:
    return {r.name for r in ps.store}


async def test_a_ps_joins_and_leaves_while_training_runs_and_nothing_is_lost_or_doubled():
    async with InProcessCluster(num_ps=2, num_workers=2) as cluster:
        extra = ParameterServer(2, token=cluster.token)
        await extra.start()
        try:
            strategy = _strategy(cluster)
            coordinator = pstrain.ClusterCoordinator(strategy)
            async with strategy.scope():
                emb = pstrain.Variable(np.zeros((ROWS, DIM), np.float32), name="emb")
                dense = pstrain.Variable(np.zeros(DIM, np.float32), name="dense")
                opt = pstrain.optimizers.SGD(1.0)

            async def step_fn(step: int) -> None:
                ids, rows, d = _grads(step)
                await opt.apply_gradients([(pstrain.IndexedSlices(rows, ids), emb), (d, dense)])

            done: list[pstrain.RemoteValue] = []
            for step in range(STEPS // 4):
                done.append(coordinator.schedule(step_fn, args=(step,), exactly_once=True))
            await wait_for(lambda: coordinator.closures_done >= 5, timeout=30.0, what="training to start")
            index = await coordinator.add_ps(extra.address)  # while closures run
            assert index == 2
            # half the table (and maybe a small part whose move evens the bytes out)
            assert len(_held(extra) & {"emb/part_0", "emb/part_1"}) == 1
            for step in range(STEPS // 4, STEPS // 2):
                done.append(coordinator.schedule(step_fn, args=(step,), exactly_once=True))
            await wait_for(
                lambda: coordinator.closures_done >= STEPS // 2 - 5, timeout=30.0, what="more training"
            )
            status = coordinator.statistics()["placement"]
            extra_bytes = status["ps"][2]["bytes"] - ROWS // 2 * DIM * 4  # half the table, and
            assert status["version"] >= 2 and extra_bytes in (0, DIM // 2 * 4)  # maybe a dense part
            # every ps holds what the map says, and nothing else
            for k, ps in enumerate([*cluster.ps, extra]):
                on = {
                    key
                    for key, (home, _) in strategy.placement.placed.items()
                    if coordinator.ps.placement.ps_of(key, home) == k
                }
                assert _held(ps) == on  # SGD keeps no slots

            await coordinator.join()  # the workers' maps still put half the table on ps 2
            await coordinator.remove_ps(2)
            await extra.stop()  # it left: the workers find out from the other ps
            for step in range(STEPS // 2, STEPS):
                done.append(coordinator.schedule(step_fn, args=(step,), exactly_once=True))
            await coordinator.join()
            assert _held(extra) == set()
            # the workers route by the newest map (learnt from a refusal, or with a batch of
            # closures sent after it changed)
            newest = coordinator.ps.placement.version
            assert [w.channels.session.routes.version for w in cluster.workers] == [newest, newest]
            assert coordinator.statistics()["placement"]["ps"][2]["active"] is False
            emb_expected, dense_expected = _expected()
            np.testing.assert_array_equal(await emb.read_value(), emb_expected)
            np.testing.assert_array_equal(await dense.read_value(), dense_expected)
            assert int(await opt.iterations.read_value()) == STEPS
            await coordinator.close()
        finally:
            await extra.stop()  # (again, if a failure came first: stopping twice is harmless)


async def test_a_request_by_an_old_map_is_refused_with_the_new_map_and_applied_once():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy, coordinator = _plain(cluster)
        async with strategy.scope():
            with strategy.placement.colocated(0):
                v = pstrain.Variable(np.zeros(3, np.float32), name="v")
        # an exactly-once closure's first attempt adds 1 on ps 0 ...
        set_dispatch(None, "closure-1")
        await v.assign_add(np.ones(3, np.float32))
        await coordinator.ps.move(["v"], 1)
        assert "v" in _held(cluster.ps[1]) and "v" not in _held(cluster.ps[0])
        # ... its retry, after the move, is recognised on ps 1 and not applied again
        set_dispatch(None, "closure-1")
        await v.assign_add(np.ones(3, np.float32))
        set_dispatch(None, None)
        assert (await v.read_value()).tolist() == [1, 1, 1]
        # a client still on the old map is refused by ps 0 with the new map, applying nothing
        channel = Channel(cluster.ps[0].address, token=cluster.token, task="/job:ps/replica:0/task:0")
        try:
            with pytest.raises(PlacementChangedError) as caught:
                await channel.request(AssignAdd(name="v", value=np.ones(3, np.float32)))
            assert caught.value.placement["moved"] == {"v": 1}
            assert caught.value.placement["version"] == coordinator.ps.placement.version
        finally:
            await channel.close()
        assert (await v.read_value()).tolist() == [1, 1, 1]
        await v.assign_add(np.ones(3, np.float32))  # the coordinator's own handle follows
        assert (await v.read_value()).tolist() == [2, 2, 2]
        await coordinator.ps.move(["v"], 0)  # and back home: the map lists nothing
        assert coordinator.ps.placement.moved == {}
        assert (await v.read_value()).tolist() == [2, 2, 2]
        await coordinator.close()


async def test_an_update_outside_exactly_once_closures_sent_again_after_a_move_is_applied_once():
    """A request whose connection drops before its reply (its ps drained and left) is sent
    again where the variable is now, under the same operation: the ps that took the
    variable over knows it was applied, also for code that is not an exactly-once closure
    (every operation gets a key of its own)."""
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy, coordinator = _plain(cluster)
        async with strategy.scope():
            with strategy.placement.colocated(0):
                v = pstrain.Variable(np.zeros(3, np.float32), name="v")
        with one_operation():  # the operation's first send, then its send again
            await v.assign_add(np.ones(3, np.float32))
            await coordinator.ps.move(["v"], 1)
            await v.assign_add(np.ones(3, np.float32))
        assert (await v.read_value()).tolist() == [1, 1, 1]
        with one_operation():  # a new operation is applied
            await v.assign_add(np.ones(3, np.float32))
        await v.assign_add(np.ones(3, np.float32))  # (each call its own operation)
        assert (await v.read_value()).tolist() == [3, 3, 3]
        await coordinator.close()


async def test_a_ps_that_asks_to_join_again_keeps_its_index_and_nothing_changes():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        extra = ParameterServer(2, token=cluster.token)
        await extra.start()
        strategy, coordinator = _plain(cluster)
        try:
            async with strategy.scope():
                with strategy.placement.colocated(0):  # two on ps 0: one moves to the new ps
                    v = pstrain.Variable(np.zeros(3, np.float32), name="v")
                    w = pstrain.Variable(np.ones(3, np.float32), name="w")
            endpoint = await coordinator.serve_metrics()
            given = await join(endpoint, extra.address, cluster.token, ps=True)
            assert given == 2
            # asked again before joining (its reply lost): the same index, kept for it
            assert await join(endpoint, extra.address, cluster.token, ps=True) == 2
            assert await join(endpoint, extra.address, cluster.token, ps=True, index=given) == 2
            await wait_for(
                lambda: coordinator.ps.moving is None and coordinator.ps.moves_done >= 1,
                timeout=30.0,
                what="v to move to the ps that joined",
            )
            placement = coordinator.ps.placement
            assert placement.ps == [*cluster.cluster_spec.job_tasks("ps"), extra.address]
            for index in (None, 2):  # asked again once in the job: nothing changes
                assert await join(endpoint, extra.address, cluster.token, ps=True, index=index) == 2
            assert coordinator.ps.placement == placement and coordinator.ps.moving is None
            assert (await v.read_value()).tolist() == [0, 0, 0]
            assert (await w.read_value()).tolist() == [1, 1, 1]
            assert len(_held(extra)) == 1
        finally:
            await coordinator.close()
            await extra.stop()


async def test_a_variable_a_ps_with_a_budget_cannot_hold_is_not_moved_there(tmp_path):
    budget = 1 << 20
    options = {"memory_budget": budget, "table_dir": str(tmp_path / "tier")}
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options=options) as cluster:
        strategy, coordinator = _plain(cluster)
        value = np.full((budget // 96, 16), 2.0, np.float32)  # 2/3 of a budget each
        async with strategy.scope():
            with strategy.placement.colocated(0):
                v = pstrain.Variable(value, name="v")
            with strategy.placement.colocated(1):
                w = pstrain.Variable(value, name="w")
            await w.read_value()
        version = coordinator.ps.placement.version
        with pytest.raises(ResourceExhaustedError, match="memory budget"):
            await coordinator.ps.move(["v"], 1)
        assert "v" in _held(cluster.ps[0]) and "v" not in _held(cluster.ps[1])
        assert coordinator.ps.placement.version == version
        await v.assign_add(np.ones_like(value))
        np.testing.assert_array_equal(await v.read_value(), value + 1)
        await coordinator.close()


async def test_bad_requests_to_move_are_refused_and_change_nothing():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy, coordinator = _plain(cluster)
        async with strategy.scope():
            v = pstrain.Variable(np.zeros(3, np.float32), name="v")
            await v.read_value()
        version = coordinator.ps.placement.version
        with pytest.raises(InvalidArgumentError, match="no active ps 5"):
            await coordinator.remove_ps(5)
        with pytest.raises(InvalidArgumentError, match="no active ps '0'"):  # a string, not ps 0
            await coordinator.remove_ps("0")
        with pytest.raises(InvalidArgumentError, match="not variables of this strategy"):
            await coordinator.ps.move(["nope"], 1)
        with pytest.raises(InvalidArgumentError, match="no active ps 7"):
            await coordinator.ps.move(["v"], 7)
        with pytest.raises(InvalidArgumentError, match="address"):
            await coordinator.add_ps("not an address")
        assert coordinator.ps.placement.version == version
        await coordinator.remove_ps(1)
        with pytest.raises(FailedPreconditionError, match="only ps"):
            await coordinator.remove_ps(0)
        assert (await v.read_value()).tolist() == [0, 0, 0]
        await coordinator.close()


async def test_a_moves_steps_come_only_from_the_coordinator_that_started_it():
    """Every step of a move carries its coordinator: a step sent by another one is refused
    and changes nothing; the one that started the move can still end it."""
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy, coordinator = _plain(cluster)
        async with strategy.scope():
            with strategy.placement.colocated(0):
                v = pstrain.Variable(np.arange(3, dtype=np.float32), name="v")
        await v.read_value()
        moves = cluster.ps[0].moves
        channels = {}
        for owner in ("a" * 32, "b" * 32):
            channels[owner] = Channel(
                cluster.ps[0].address, token=cluster.token, task="/job:ps/replica:0/task:0"
            )
            channels[owner].session.owner = owner
        first, other = channels.values()
        try:
            await first.request(MoveOut(keys=["v"], stage="s1"))
            assert moves.stages.owners == {("out", "s1"): "a" * 32}
            with pytest.raises(FailedPreconditionError, match="started here by another coordinator"):
                await other.request(EndMove(stage="s1", commit=False))
            assert "s1" in moves.outgoing
            assert (await first.request(EndMove(stage="s1", commit=False))).ended
            assert not moves.outgoing and not moves.stages.owners
        finally:
            for channel in channels.values():
                await channel.close()
        assert (await v.read_value()).tolist() == [0, 1, 2]
        await coordinator.close()


async def test_a_worker_that_learnt_an_old_coordinators_map_routes_by_the_new_ones():
    """A worker learnt the old coordinator's map (v moved to ps 1); a new coordinator,
    restarted on the same cluster file, creates v where it was first created (ps 0).
    The worker's closures update the new coordinator's v, not the old one's copy."""

    async def bump(var):
        await var.assign_add(np.ones(3, np.float32))

    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        values, coordinators = [], []
        for generation in range(2):
            strategy, coordinator = _plain(cluster)
            strategy.placement.namespace = ""  # a restarted coordinator: the same keys
            coordinators.append(coordinator)
            async with strategy.scope():
                with strategy.placement.colocated(0):
                    v = pstrain.Variable(np.zeros(3, np.float32), name="v")
                with strategy.placement.colocated(1):  # the new one takes ps 1 over through u
                    pstrain.Variable(np.zeros(3, np.float32), name="u")
            if generation == 0:
                await coordinator.ps.move(["v"], 1)
            coordinator.schedule(bump, args=(v,))
            await coordinator.join()
            values.append((await v.read_value()).tolist())
        assert values == [[1, 1, 1], [1, 1, 1]]
        # the copy the old one moved to ps 1 went when the new one took ps 1 over (through u)
        assert {r.name for r in cluster.ps[1].store} == {"u"}
        for coordinator in coordinators:
            await coordinator.close()


async def test_a_coordinators_maps_count_on_a_ps_that_knew_another_ones_higher_versions():
    """A coordinator that moved variables (its maps at version 4 and up) is gone; another
    one, whose variables are named apart (nothing of the first is taken over), moves one
    of its own: its maps start at version 1 again. The ps know its maps, not the first's,
    so its closures' updates are routed to where its variable is now."""

    async def bump(var):
        await var.assign_add(np.ones(3, np.float32))

    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        old_strategy, old = _plain(cluster)
        async with old_strategy.scope():
            with old_strategy.placement.colocated(0):
                a = pstrain.Variable(np.zeros(3, np.float32), name="a")
        for ps in (1, 0, 1, 0):
            await old.ps.move([a.key], ps)
        await old.close()
        old_version = cluster.ps[0].store.placement.version
        assert old_version >= 4
        strategy, coordinator = _plain(cluster)
        async with strategy.scope():
            with strategy.placement.colocated(0):
                v = pstrain.Variable(np.zeros(3, np.float32), name="v")
        assert v.key != "v"  # named apart: the first strategy still lives in this process
        await coordinator.ps.move([v.key], 1)
        assert coordinator.ps.placement.version < old_version  # its maps number from 1
        for _ in range(3):
            coordinator.schedule(bump, args=(v,))
        await coordinator.join()
        assert (await v.read_value()).tolist() == [3, 3, 3]
        assert cluster.ps[0].store.placement.moved == {v.key: 1}
        await coordinator.close()


async def test_a_coordinator_started_again_after_a_ps_left_says_what_to_do_and_then_restores_exactly(
    tmp_path,
):
    """Faults that combine: ps 1 of 3 leaves (its variable and table rows move to the
    others), the job saves, the coordinator stops, and ps 1's process is gone. A coordinator
    started again on the same cluster spec cannot reach ps 1: the error names both ways on.
    One that calls ``remove_ps(1)`` before making the variables places them on the two ps
    left, restores every value there and trains; or an empty ps started at ps 1's address
    serves, and the restore puts every value back on three."""
    root = str(tmp_path)

    def model(strategy: pstrain.ParameterServerStrategy) -> tuple[list[pstrain.Variable], Any]:
        with strategy.scope():
            variables = [pstrain.Variable(np.zeros(4, np.float32), name=f"v{i}") for i in range(3)]
            table = pstrain.DynamicEmbedding(4, name="t", initializer=pstrain.initializers.Zeros())
        return variables, table

    ids = np.arange(-50, 50, dtype=np.int64) * 7919
    async with InProcessCluster(num_ps=3, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        strategy, coordinator = _plain(cluster)
        variables, table = model(strategy)
        await table.lookup(ids)
        for i, v in enumerate(variables):
            await v.assign(np.full(4, i + 1.0, np.float32))
        with strategy.scope():
            opt = pstrain.optimizers.SGD(1.0)
        await opt.apply_gradients([(pstrain.IndexedSlices(-np.ones((ids.size, 4), np.float32), ids), table)])
        await coordinator.remove_ps(1)
        path = await pstrain.Checkpoint(vs=variables, t=table).save(root + "/ckpt")
        await coordinator.close()
        host, port = cluster.ps[1].address.rsplit(":", 1)
        await cluster.ps[1].stop()

        strategy, coordinator = _plain(cluster)
        strategy.placement.startup_timeout_s = 1.0
        variables, table = model(strategy)
        with pytest.raises(
            UnavailableError,
            match="If it left the job before this coordinator started .* start a ps there again",
        ) as info:
            await strategy.flush()
        assert "await coordinator.remove_ps(1) before making the variables" in str(info.value)
        await coordinator.close()

        async def bump(var):
            await var.assign_add(np.ones(4, np.float32))

        strategy, coordinator = _plain(cluster)  # without ps 1, as the error says
        await coordinator.remove_ps(1)
        variables, table = model(strategy)
        assert sorted({v.ps_index for v in variables}) == [0, 2]
        (await pstrain.Checkpoint(vs=variables, t=table).restore(path)).assert_consumed()
        got_ids, rows = await table.export()
        np.testing.assert_array_equal(got_ids, np.sort(ids))
        np.testing.assert_array_equal(rows, np.ones((ids.size, 4), np.float32))
        for v in variables:
            coordinator.schedule(bump, args=(v,))
        await coordinator.join()
        for i, v in enumerate(variables):
            np.testing.assert_array_equal(await v.numpy(), np.full(4, i + 2.0, np.float32))
        await coordinator.close()

        fresh = ParameterServer(1, host=host, port=int(port), token=cluster.token, checkpoint_root=root)
        await fresh.start()
        try:
            strategy, coordinator = _plain(cluster)
            variables, table = model(strategy)
            (await pstrain.Checkpoint(vs=variables, t=table).restore(path)).assert_consumed()
            for i, v in enumerate(variables):
                np.testing.assert_array_equal(await v.numpy(), np.full(4, i + 1.0, np.float32))
            got_ids, rows = await table.export()
            np.testing.assert_array_equal(got_ids, np.sort(ids))
            np.testing.assert_array_equal(rows, np.ones((ids.size, 4), np.float32))
            await coordinator.close()
        finally:
            await fresh.stop()
