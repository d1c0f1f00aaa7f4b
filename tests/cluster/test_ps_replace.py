"""A lost ps is replaced from delta checkpoints while the others train: its variables and
optimizer slots come back on the other ps as of the latest delta, the closures it failed run
again, and the ps that kept their updates apply them once (exactly-once closures)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pstrain
from pstrain._formats.messages.operations import AssignAdd
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from pstrain.cluster import listening_socket
from pstrain.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PlacementChangedError,
    ResourceExhaustedError,
)
from pstrain.rpc import Channel
from pstrain.server import ParameterServer
from pstrain.testing import InProcessCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)

ROWS, DIM, LR, MOMENTUM = 600, 4, 0.5, 0.5
SAVED, DELTA, LOST, END = 10, 15, 18, 30  # full save after step 9, a delta after 14, ps 1 lost after 17


def _grads(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    ids = rng.choice(ROWS, 32, replace=False)
    return (
        ids,
        rng.integers(-3, 4, (32, DIM)).astype(np.float32),
        rng.integers(-3, 4, (DIM,)).astype(np.float32),
    )


def _expected(lost_rows: slice | None, dense_lost: bool) -> dict[str, np.ndarray]:
    """SGD with momentum over steps 0..END-1, where the rows ``lost_rows`` of the table (and
    the dense vector if ``dense_lost``) miss the steps DELTA..LOST-1: they were on the ps
    that was lost after them, and came back as of the delta."""
    emb, m_emb = np.zeros((ROWS, DIM), np.float32), np.zeros((ROWS, DIM), np.float32)
    dense, m_dense = np.zeros(DIM, np.float32), np.zeros(DIM, np.float32)
    keep = np.ones(ROWS, bool)
    for step in range(END):
        ids, rows, d = _grads(step)
        skipped = DELTA <= step < LOST
        if skipped and lost_rows is not None:
            keep[:] = True
            keep[lost_rows] = False
            rows, ids = rows[keep[ids]], ids[keep[ids]]
        m_emb[ids] = np.float32(MOMENTUM) * m_emb[ids] - np.float32(LR) * rows
        emb[ids] += m_emb[ids]
        if not (skipped and dense_lost):
            m_dense = np.float32(MOMENTUM) * m_dense - np.float32(LR) * d
            dense += m_dense
    return {"emb": emb, "m_emb": m_emb, "dense": dense, "m_dense": m_dense}


def _cluster(root) -> InProcessCluster:
    """Three in-process ps that may write checkpoints under ``root``, and one worker (one
    closure at a time: SGD with momentum depends on the order of the steps)."""
    return InProcessCluster(num_ps=3, num_workers=1, ps_options={"checkpoint_root": str(root)})


def _job(cluster: InProcessCluster):
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token),
        variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(3),
    )
    return strategy, pstrain.ClusterCoordinator(strategy)


async def _model(strategy: pstrain.ParameterServerStrategy, directory: str):
    async with strategy.scope():
        emb = pstrain.Variable(np.zeros((ROWS, DIM), np.float32), name="emb")
        with strategy.placement.colocated(1):
            dense = pstrain.Variable(np.zeros(DIM, np.float32), name="dense")
            on_lost = pstrain.Variable(np.zeros((), np.int64), name="on_lost")
        with strategy.placement.colocated(0):
            on_kept = pstrain.Variable(np.zeros((), np.int64), name="on_kept")
        opt = pstrain.optimizers.SGD(LR, momentum=MOMENTUM)
    ckpt = Checkpoint(emb=emb, dense=dense, on_lost=on_lost, on_kept=on_kept, opt=opt)
    return emb, dense, on_lost, on_kept, opt, CheckpointManager(ckpt, directory)


async def _successor(successor: str | None, address: str, token: str):
    """What starts at a lost ps's address: nothing, another kind of server, another job's
    ps (its own token), or this ps restarted empty (a supervisor's restart, this job's
    token); returns what stops it."""
    port = int(address.rsplit(":", 1)[1])
    if successor is None:
        return None
    if successor == "another server":

        async def http(reader, writer):
            await reader.read(8)
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(http, sock=listening_socket("127.0.0.1", port, "the successor"))

        async def stop() -> None:
            server.close()
            await server.wait_closed()

        return stop
    ps = ParameterServer(
        1, token=token if successor == "restarted empty" else "another-jobs-token", port=port
    )
    await ps.start()
    return ps.stop


@pytest.mark.parametrize("successor", [None, "another server", "another job's ps", "restarted empty"])
async def test_a_ps_lost_mid_training_is_replaced_from_base_and_deltas_and_training_goes_on(
    tmp_path, successor
):
    """Whether its address stays empty or another server answers there after it (a port
    taken, an address given to another machine): a ps reached before is lost, not a
    misconfiguration. So is one a supervisor restarted at once, empty: the closures that
    find their variables gone there are held while it is replaced, not failed."""
    async with _cluster(tmp_path) as cluster:
        strategy, coordinator = _job(cluster)
        emb, dense, on_lost, on_kept, opt, manager = await _model(strategy, str(tmp_path))

        async def step_fn(step: int) -> None:
            ids, rows, d = _grads(step)
            await opt.apply_gradients([(pstrain.IndexedSlices(rows, ids), emb), (d, dense)])
            await on_lost.assign_add(1)
            await on_kept.assign_add(1)

        async def run(start: int, stop: int) -> None:
            for step in range(start, stop):
                coordinator.schedule(step_fn, args=(step,), exactly_once=True)
            await coordinator.join()

        await run(0, SAVED)
        await manager.save()
        await run(SAVED, DELTA)
        delta = await manager.save_delta()
        assert ".delta-" in delta
        await run(DELTA, LOST)  # these updates on ps 1 are lost with it
        lost_part = next(j for j, p in enumerate(emb.variables) if p.ps_index == 1)
        lost_keys = {k for k, (home, _) in strategy.placement.placed.items() if home == 1}

        coordinator.replace_lost_ps(manager)
        await cluster.ps[1].stop()  # killed: its variables are gone
        stop_successor = await _successor(successor, cluster.ps[1].address, cluster.token)
        try:
            await run(LOST, END)  # the first closures fail on ps 1, are held, and run again
        finally:
            if stop_successor is not None:
                await stop_successor()

        status = coordinator.statistics()["placement"]
        assert status["ps"][1]["active"] is False and status["replacing"] == []
        (replaced,) = status["replaced"]
        assert replaced["ps"] == 1 and replaced["checkpoint"] == delta
        # a table part, dense, on_lost (and the step counter or its mirror, if either was there)
        assert replaced["variables"] == len(lost_keys) and {"dense", "on_lost"} <= lost_keys
        assert replaced["keys"] == sorted(lost_keys)
        assert coordinator.statistics()["ps_replaced"] == 1
        placement = coordinator.ps.placement
        assert {placement.ps_of(k, 1) for k in lost_keys} <= {0, 2}
        held = {r.name for ps in (cluster.ps[0], cluster.ps[2]) for r in ps.store}
        assert lost_keys <= held

        # the ps that kept their state applied every step once; ps 1's came back as of the delta
        assert int(await on_kept.read_value()) == END
        assert int(await on_lost.read_value()) == DELTA + (END - LOST)
        # the step counter kept every step: it or its mirror was on a ps that kept its state
        assert int(await opt.iterations.read_value()) == END
        assert int(await opt.iterations_mirror.read_value()) == END
        counted_on_lost = 1 in (opt.iterations.home_ps, opt.iterations_mirror.home_ps)
        # the steps counted since the delta: those whose updates to ps 1 were lost, and the
        # one or two in flight then (they ran again, so theirs were not)
        since = replaced["steps_since_checkpoint"]
        assert (LOST - DELTA <= since <= LOST - DELTA + 2) if counted_on_lost else since is None
        lo, hi = emb.offsets[lost_part], emb.offsets[lost_part + 1]
        want = _expected(slice(lo, hi), dense_lost=True)
        np.testing.assert_allclose(await emb.read_value(), want["emb"], rtol=1e-6)
        np.testing.assert_allclose(await dense.read_value(), want["dense"], rtol=1e-6)

        # the next delta follows the variables where they are now, and reads back as they are
        later = await manager.save_delta()
        saved = load_variables(later)
        np.testing.assert_array_equal(saved["emb"], await emb.read_value())
        np.testing.assert_array_equal(saved["dense"], await dense.read_value())
        slots = {k: v for k, v in saved.items() if "OPTIMIZER_SLOT" in k}
        np.testing.assert_allclose(slots["emb/.OPTIMIZER_SLOT/opt/momentum"], want["m_emb"], rtol=1e-6)
        np.testing.assert_allclose(slots["dense/.OPTIMIZER_SLOT/opt/momentum"], want["m_dense"], rtol=1e-6)
        await coordinator.close()


async def test_replace_ps_on_request_moves_onto_a_joined_ps_and_fences_the_old_one(tmp_path):
    async with _cluster(tmp_path) as cluster:
        extra = ParameterServer(3, token=cluster.token, checkpoint_root=str(tmp_path))
        await extra.start()
        try:
            strategy, coordinator = _job(cluster)
            emb, dense, on_lost, on_kept, opt, manager = await _model(strategy, str(tmp_path))
            # bad requests change nothing
            version = coordinator.ps.placement.version
            with pytest.raises(FailedPreconditionError, match="no checkpoint"):
                await coordinator.replace_ps(1, manager)
            with pytest.raises(InvalidArgumentError, match="no active ps 7"):
                await coordinator.replace_ps(7, manager)
            await on_lost.assign_add(5)
            await manager.save()
            await on_lost.assign_add(2)
            await manager.save_delta()
            await on_lost.assign_add(100)  # after the delta: lost
            with pytest.raises(InvalidArgumentError, match="cannot take"):
                await coordinator.replace_ps(1, manager, to=1)
            assert coordinator.ps.placement.version == version

            to = await coordinator.ps.admit_ps(extra.address)
            # ps 1 is alive (a partition, say): replaced all the same, it must then serve nothing
            await coordinator.replace_ps(1, manager, to=to)
            assert {r.name for r in extra.store} >= {"on_lost", "dense"}
            assert int(await on_lost.read_value()) == 7
            await wait_for(
                lambda: len(cluster.ps[1].store) == 0, timeout=30.0, what="ps 1 to be fenced"
            )  # told it left
            channel = Channel(cluster.ps[1].address, token=cluster.token, task="/job:ps/replica:0/task:1")
            try:
                with pytest.raises(PlacementChangedError) as caught:  # a client on the old map
                    await channel.request(AssignAdd(name="on_lost", value=np.asarray(np.int64(1))))
                assert caught.value.placement["moved"]["on_lost"] == to
            finally:
                await channel.close()
            assert int(await on_lost.read_value()) == 7
            with pytest.raises(InvalidArgumentError, match="no active ps 1"):
                await coordinator.replace_ps(1, manager)
            await coordinator.close()
        finally:
            await extra.stop()


async def test_a_replacement_a_ps_refuses_installs_nothing_anywhere(tmp_path):
    """One of the ps that would take the lost one's variables cannot (it is full): no
    other ps serves any of them either; the error says why."""
    async with _cluster(tmp_path) as cluster:
        strategy, coordinator = _job(cluster)
        emb, dense, on_lost, on_kept, opt, manager = await _model(strategy, str(tmp_path))
        await manager.save()
        lost = {k for k, (home, _) in strategy.placement.placed.items() if home == 1}
        cluster.ps[2].moves.max_store_bytes = cluster.ps[2].store.held()  # full: takes nothing more
        await cluster.ps[1].stop()
        with pytest.raises(ResourceExhaustedError, match="cannot take.*--max-store-bytes"):
            await coordinator.replace_ps(1, manager)
        for ps in (cluster.ps[0], cluster.ps[2]):
            assert not lost & {r.name for r in ps.store}, "a copy went into service"
            assert not ps.moves.incoming  # what was staged was dropped
        await coordinator.close()
