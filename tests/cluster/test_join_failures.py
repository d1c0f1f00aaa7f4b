"""A ps that fails to join leaves the job's ps as they were: the placement map is published
only once the new ps answered as its index, withdrawn if any ps refuses it, and a ps that
dies before anything moved to it is taken out again. One test per failure point: nothing
listens, the wrong task answers (400), the ps refuses the map (503), the ps never
answers (timeout), the ps dies during the first move. A worker that asks to join at an
address where no pstrain worker of the job answers is refused the same way."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import pstrain
from pstrain._formats.messages.placement_map import InstallVariables, PullMove, SetPlacement
from pstrain.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ProtocolError,
    PstrainError,
    UnavailableError,
)
from pstrain.rpc import Channel
from pstrain.server import ParameterServer, WorkerServer
from pstrain.testing import InProcessCluster, untyped_call

pytestmark = pytest.mark.timeout(120)


async def _job(cluster: InProcessCluster):
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
    )
    coordinator = pstrain.ClusterCoordinator(strategy)
    coordinator.ps.timeout_s = 3.0
    async with strategy.scope():
        v = pstrain.Variable(np.arange(4, dtype=np.float32), name="v")
        w = pstrain.Variable(np.ones((64, 4), np.float32), name="w")
        pstrain.Variable(np.ones((64, 4), np.float32), name="u")  # round-robin: on ps 0
    await v.read_value()
    return coordinator, v, w


async def _unchanged(cluster, coordinator, version: int, v, w) -> None:
    """The map is as before the join (a newer version may withdraw one that was sent), and
    the job goes on: a ps can still leave, and the variables read as they were."""
    placement = coordinator.ps.placement
    assert placement.active() == [0, 1] and placement.version >= version
    assert [a for a in placement.ps if a] == [ps.address for ps in cluster.ps]
    for ps in cluster.ps:  # every ps routes by the withdrawing map too
        assert ps.store.placement.active() in ([], [0, 1])  # none yet, or the same two
    await coordinator.remove_ps(1)
    assert (await v.read_value()).tolist() == [0, 1, 2, 3]
    assert float((await w.read_value()).sum()) == 256.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_join_where_nothing_listens_changes_nothing():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        coordinator, v, w = await _job(cluster)
        version = coordinator.ps.placement.version
        with pytest.raises(UnavailableError, match="did not join"):
            await coordinator.add_ps(f"127.0.0.1:{_free_port()}")
        assert coordinator.ps.placement.version == version  # nothing was published
        await _unchanged(cluster, coordinator, version, v, w)
        await coordinator.close()


async def test_a_join_answered_by_another_task_400_changes_nothing():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        coordinator, v, w = await _job(cluster)
        version = coordinator.ps.placement.version
        other = ParameterServer(7, token=cluster.token)  # answers as ps 7, not ps 2
        await other.start()
        try:
            with pytest.raises(InvalidArgumentError, match="did not answer as /job:ps/replica:0/task:2"):
                await coordinator.add_ps(other.address)
            assert coordinator.ps.placement.version == version
            await _unchanged(cluster, coordinator, version, v, w)
        finally:
            await other.stop()
        await coordinator.close()


async def test_a_join_whose_map_the_new_ps_refuses_503_is_withdrawn():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        coordinator, v, w = await _job(cluster)
        version = coordinator.ps.placement.version
        extra = ParameterServer(2, token=cluster.token)

        def refuse(req: SetPlacement) -> None:
            raise UnavailableError("draining (the test's refusal)")

        extra.route(SetPlacement, refuse)
        await extra.start()
        try:
            with pytest.raises(UnavailableError, match="draining"):
                await coordinator.add_ps(extra.address)
            assert coordinator.ps.placement.version == version + 2  # sent, then withdrawn
            await _unchanged(cluster, coordinator, version, v, w)
        finally:
            await extra.stop()
        await coordinator.close()


async def test_a_join_that_never_answers_times_out_and_changes_nothing():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, never answers
        writer.close()

    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        coordinator, v, w = await _job(cluster)
        version = coordinator.ps.placement.version
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises((DeadlineExceededError, UnavailableError), match="did not join"):
                await coordinator.add_ps(f"127.0.0.1:{port}")
            assert coordinator.ps.placement.version == version
            await _unchanged(cluster, coordinator, version, v, w)
        finally:
            server.close()
            await server.wait_closed()
        await coordinator.close()


async def test_a_ps_that_dies_during_its_first_move_is_taken_out_again():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        coordinator, v, w = await _job(cluster)
        version = coordinator.ps.placement.version
        extra = ParameterServer(2, token=cluster.token)
        died = asyncio.Event()

        stopping = []

        def die(req: PullMove | InstallVariables) -> None:  # the ps goes away as the first
            died.set()  # move reaches it (it pulls the copy from the source: step 1)
            stopping.append(asyncio.ensure_future(extra.stop()))
            raise UnavailableError("stopping")

        extra.route(PullMove, die)
        extra.route(InstallVariables, die)
        await extra.start()
        try:
            with pytest.raises(PstrainError, match="taken out of the job again"):
                await coordinator.add_ps(extra.address)  # u, on the fullest ps, moves first
        finally:
            await asyncio.gather(*stopping)
            await extra.stop()  # stopped already unless the test failed before
        assert died.is_set()
        await _unchanged(cluster, coordinator, version, v, w)
        await coordinator.close()


async def test_move_out_of_slices_the_ps_does_not_hold_is_refused_at_the_first_step():

    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
        )
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="emb", capacity=100)
        await table.lookup(np.arange(20, dtype=np.int64))
        channel = Channel(cluster.ps[0].address, token=cluster.token, task="/job:ps/replica:0/task:0")
        moves = cluster.ps[0].moves
        try:
            # ps 0 holds shard 0 of 2: slices 0, 2, 4, 6 of 8; slice 1 is ps 1's
            with pytest.raises(InvalidArgumentError, match=r"does not hold slices \[1\]"):
                await untyped_call(
                    channel,
                    "ps/move_out",
                    {"stage": "s1", "keys": [], "tables": {table.key: {"slices": 8, "owned": [0, 1]}}},
                )
            with pytest.raises(InvalidArgumentError, match="does not hold slices"):
                await untyped_call(
                    channel,
                    "ps/move_out",
                    {"stage": "s2", "keys": [], "tables": {table.key: {"slices": 3, "owned": [0]}}},
                )
            assert not moves.outgoing and not moves.outgoing_tables and not moves.stages.owners
            out = await untyped_call(
                channel,
                "ps/move_out",
                {"stage": "s3", "keys": [], "tables": {table.key: {"slices": 8, "owned": [2]}}},
            )
            assert out["tables"]  # a slice it holds: taken
            await untyped_call(channel, "ps/move_end", {"stage": "s3", "commit": False})
        finally:
            await channel.close()


async def test_a_worker_join_where_no_worker_of_the_job_answers_is_refused_and_changes_nothing():
    """Through the coordinator's endpoint, as ``pstrain serve --role worker --join`` asks:
    an address where another kind of server answers (before, its slot was taken and the
    first closure sent there failed the whole job), where nothing listens, or where a ps
    of the job answers. Each is refused with the reason; the job's one worker stays, and
    its closures run. A real worker then joins and the job grows."""

    async def not_pstrain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(64)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        coordinator, v, _ = await _job(cluster)
        endpoint = Channel(
            await coordinator.serve_metrics(), token=cluster.token, task="/job:chief/replica:0/task:0"
        )
        http = await asyncio.start_server(not_pstrain, "127.0.0.1", 0)
        joiner = WorkerServer(5, token=cluster.token)
        joiner.joined = True  # as --join makes it: it takes the index its coordinator gives
        try:
            assert await coordinator.schedule(lambda: 6) == 6  # worker 0 is up
            refusals = [
                (f"127.0.0.1:{http.sockets[0].getsockname()[1]}", ProtocolError, "not a pstrain server"),
                (f"127.0.0.1:{_free_port()}", UnavailableError, "cannot be reached"),
                (cluster.ps[0].address, PstrainError, "is /job:ps/replica:0/task:0"),
            ]
            for address, error, reason in refusals:
                with pytest.raises(
                    error, match=rf"worker at {address} did not answer as .*task:1.* {reason}"
                ):
                    await untyped_call(endpoint, "coordinator/join", {"address": address})
                assert [(m["address"], m["state"]) for m in coordinator.membership()] == [
                    (cluster.workers[0].address, "up")
                ]
            assert coordinator.strategy.num_workers == 1
            assert await coordinator.schedule(lambda: 7) == 7
            await coordinator.join()  # no error was recorded for the job

            await joiner.start()
            reply = await untyped_call(endpoint, "coordinator/join", {"address": joiner.address})
            assert reply["index"] == 1 and coordinator.strategy.num_workers == 2
            rvs = [coordinator.schedule(lambda: pstrain.get_current_worker_index()) for _ in range(64)]
            await coordinator.join()
            assert {await rv for rv in rvs} <= {0, 1} and joiner.index == 1
        finally:
            http.close()
            await http.wait_closed()
            await endpoint.close()
            await coordinator.close()
            await joiner.stop()
