"""Configuration errors fail fast, typed, naming the task and the fix; `pstrain status` shows
them; a closure that forgets `await` fails; no worker at all fails join() after its deadline.
A worker reached before whose address another server answers at later is lost, not a
configuration error."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest

import pstrain
from pstrain.cluster import listening_socket
from pstrain.errors import (
    CancelledError,
    InvalidArgumentError,
    ProtocolError,
    UnavailableError,
    WrongTaskError,
)
from pstrain.server.ps import ParameterServer
from pstrain.server.worker import WorkerServer
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, join_fails, wait_for

pytestmark = pytest.mark.timeout(90)


async def test_an_address_that_is_not_a_pstrain_server():
    async def http(reader, writer):
        await reader.read(8)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    sock = listening_socket("127.0.0.1", 0, "a foreign server")
    server = await asyncio.start_server(http, sock=sock)
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    try:
        strategy = pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver({"ps": ["127.0.0.1:9"], "worker": [address]}, token=TOKEN)
        )
        coordinator = pstrain.ClusterCoordinator(strategy)
        err = await join_fails(coordinator, ProtocolError, "is not a pstrain server")
        assert "HTTP/1.1 400" in str(err) and address in str(err)
        await coordinator.close()
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("successor", ["another server", "another job's worker", "another worker of the job"])
async def test_a_worker_whose_address_another_server_takes_later_is_lost_and_the_job_goes_on(successor):
    """Worker 1 runs closures, then goes; something else starts at its address (a process
    took the port, or a machine was given the address, as pods are). That is a lost worker,
    not the configuration error the same answer means at start-up: its closures run on
    worker 0, join() raises nothing, and the slot shows why it is lost."""

    async def http(reader, writer):
        await reader.read(8)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async with InProcessCluster(num_ps=1, num_workers=2) as cluster:
        coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
        where = [coordinator.schedule(pstrain.get_current_worker_index) for _ in range(64)]
        await coordinator.join()
        assert {await rv for rv in where} == {0, 1}
        gone = cluster.workers[1]
        port = int(gone.address.rsplit(":", 1)[1])
        await gone.stop()
        if successor == "another server":
            server = await asyncio.start_server(
                http, sock=listening_socket("127.0.0.1", port, "the successor")
            )
        else:  # a pstrain worker: of another job (its own token), or this job's worker 3
            index, token = (
                (5, "another-jobs-token") if successor == "another job's worker" else (3, cluster.token)
            )
            server = WorkerServer(index, token=token, port=port)
            await server.start()
        try:
            where = [coordinator.schedule(pstrain.get_current_worker_index) for _ in range(64)]
            await asyncio.wait_for(coordinator.join(), 30)
            assert {await rv for rv in where} == {0}
            slot = coordinator.membership()[1]
            assert slot["state"] == "lost" and "another server answers there now" in slot["last_error"]
            assert coordinator.membership()[0]["state"] == "up"
        finally:
            await coordinator.close()
            if isinstance(server, WorkerServer):
                await server.stop()
            else:
                server.close()
                await server.wait_closed()


async def test_a_cluster_spec_that_does_not_match_the_tasks(cluster):
    spec = cluster.cluster_spec
    workers, ps = spec.job_tasks("worker"), spec.job_tasks("ps")
    swapped = pstrain.SimpleClusterResolver({"ps": ps, "worker": workers[::-1]}, token=cluster.token)
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(swapped))
    err = await join_fails(coordinator, InvalidArgumentError, "the task there is worker 1")
    assert "does not match" in str(err)
    await coordinator.close()
    wrong = pstrain.SimpleClusterResolver({"ps": ps, "worker": [ps[0]]}, token=cluster.token)
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(wrong))
    await join_fails(coordinator, InvalidArgumentError, "is not a worker")
    await coordinator.close()


async def test_a_forgotten_await_in_a_closure_fails_it(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        v = pstrain.Variable(0.0)

    def forgot():
        v.assign_add(1.0)  # no await: the update never runs

    async def forgot_async():
        v.assign_add(1.0)

    for fn in (forgot, forgot_async):
        rv = coordinator.schedule(fn)
        with pytest.raises(InvalidArgumentError, match=r"assign_add\(\) without `await`"):
            await coordinator.join()
        with pytest.raises(InvalidArgumentError, match="never ran"):
            await rv
    assert coordinator.schedule(lambda: v.assign_add(1.0)) is not None  # returned: awaited
    await coordinator.join()
    assert await v.numpy() == 1.0
    with pytest.warns(RuntimeWarning, match=r"assign_add\(\) was never awaited"):
        v.assign_add(5.0)  # on the coordinator: Python's warning, naming the operation
    assert await v.numpy() == 1.0
    await coordinator.close()


async def test_join_fails_when_no_worker_can_ever_run_the_queue():
    dead = [listening_socket("127.0.0.1", 0, "a dead worker") for _ in range(2)]
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in dead]
    for s in dead:
        s.close()  # reserved, then closed: connections are refused
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": ["127.0.0.1:9"], "worker": addresses}, token=TOKEN)
    )
    coordinator = pstrain.ClusterCoordinator(strategy, heartbeat_s=0.1, no_worker_timeout_s=1.0)
    err = await join_fails(coordinator, UnavailableError, "no worker has been reachable")
    for k in range(2):
        assert f"/job:worker/replica:0/task:{k} (UnavailableError" in str(err)
    assert "/job:ps/replica:0/task:0 (UnavailableError" in str(err)
    await coordinator.close()


async def test_variable_creation_waits_for_a_ps_that_is_still_starting_and_then_gives_up(caplog):
    # SLURM and Kubernetes start every task at once: the coordinator's first creation can
    # reach a ps before it listens. A port bound but not listening refuses connections.

    caplog.set_level(logging.INFO, logger="pstrain._variables.placement")

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{held.getsockname()[1]}"
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": [address], "worker": ["127.0.0.1:9"]}, token=TOKEN)
    )
    with strategy.scope():
        v = pstrain.Variable(3.0, name="late")
    creating = asyncio.ensure_future(strategy.flush())

    await wait_for(lambda: "to start" in caplog.text, timeout=10, what="the wait logged")
    assert not creating.done()
    held.close()
    server = ParameterServer(0, token=TOKEN, port=int(address.rsplit(":", 1)[1]))
    await server.start()
    try:
        await asyncio.wait_for(creating, 10)
        assert await v.numpy() == 3.0
        # A ps reached once and then gone is an error at once, not another wait.
        await server.stop()
        with strategy.scope():
            w = pstrain.Variable(1.0, name="after")
        t = time.monotonic()
        with pytest.raises(UnavailableError):
            await strategy.flush()
        assert time.monotonic() - t < 5
        del w
    finally:
        await server.stop()
        await strategy.channels.close()

    never = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": ["127.0.0.1:9"], "worker": ["127.0.0.1:9"]}, token=TOKEN)
    )
    never.placement.startup_timeout_s = 0.5
    with never.scope():
        pstrain.Variable(1.0, name="never")
    with pytest.raises(UnavailableError, match="did not start within 0.5 s"):
        await never.flush()
    await never.channels.close()


async def test_a_chief_whose_metrics_port_is_taken_says_so_in_one_line_and_trains_on(caplog):

    taken = listening_socket("127.0.0.1", 0, "a test port")
    try:
        async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
            spec = {**cluster.cluster_spec.as_dict(), "chief": [f"127.0.0.1:{taken.getsockname()[1]}"]}
            resolver = pstrain.TFConfigClusterResolver(
                {
                    "TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}),
                    "PSTRAIN_TOKEN": TOKEN,
                }
            )
            strategy = pstrain.ParameterServerStrategy(resolver)
            coordinator = pstrain.ClusterCoordinator(strategy)
            with caplog.at_level(logging.ERROR, logger="pstrain._coordinator.coordinator"):
                assert await coordinator.schedule(lambda: 7) == 7
                await coordinator.join()
                from tests.helpers import wait_for

                await wait_for(
                    lambda: "could not serve /metrics" in caplog.text, timeout=10, what="the error logged"
                )
            records = [r for r in caplog.records if "could not serve /metrics" in r.getMessage()]
            assert len(records) == 1 and records[0].exc_info is None
            await coordinator.close()
    finally:
        taken.close()


async def test_shutdown_reaches_a_ps_that_comes_up_after_the_job_is_done():
    # SLURM starts every rank at once: a ps the job never used may start listening last.

    worker = WorkerServer(0, token=TOKEN, exit_on_shutdown=True)
    await worker.start()
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": [f"127.0.0.1:{port}"], "worker": [worker.address]}, token=TOKEN)
    )
    coordinator = pstrain.ClusterCoordinator(strategy)
    assert await coordinator.schedule(lambda: 1) == 1  # the job ran without that ps
    leaving = asyncio.ensure_future(coordinator.shutdown_cluster())

    await wait_for(lambda: worker.shutdown_requested.is_set(), timeout=10, what="the worker told")
    assert not leaving.done()  # still asking the ps, which refuses connections for now
    held.close()
    ps = ParameterServer(0, token=TOKEN, port=port, exit_on_shutdown=True)
    await ps.start()
    try:
        assert await asyncio.wait_for(leaving, 30) == []
        assert ps.shutdown_requested.is_set()
    finally:
        await ps.stop()
        await worker.stop()
        await coordinator.close()


@pytest.mark.timeout(60)
async def test_a_wrong_ps_port_says_at_once_what_it_waits_for_and_ends_at_the_cluster_entry(caplog):

    with socket.socket() as nobody:  # bound, never listening: connections are refused
        nobody.bind(("127.0.0.1", 0))
        wrong = f"127.0.0.1:{nobody.getsockname()[1]}"
        async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
            spec = {**cluster.cluster_spec.as_dict(), "ps": [wrong]}
            strategy = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=TOKEN))
            strategy.placement.startup_timeout_s = 4.0
            coordinator = pstrain.ClusterCoordinator(strategy)
            try:
                with caplog.at_level(logging.WARNING, logger="pstrain._variables.placement"):
                    with strategy.scope():
                        v = pstrain.Variable(1.0, name="v")
                    rv = coordinator.schedule(lambda: v.read_value())
                    # said at once, where a user sees it (WARNING): what, where, how long
                    await wait_for(
                        lambda: "waiting up to 4 s for /job:ps/replica:0/task:0" in caplog.text,
                        timeout=3,
                        what="the wait announced",
                    )
                    entry = f'cluster["ps"][0] = "{wrong}"'
                    assert entry in caplog.text, caplog.text
                    # the closure that waited says why it did not run; join raises the cause
                    with pytest.raises(CancelledError, match="did not start within 4 s") as info:
                        await rv
                    assert entry in str(info.value)
                    assert "restarted" not in str(info.value)  # no advice about ps restarts
                    with pytest.raises(UnavailableError, match="did not start within 4 s"):
                        await coordinator.join()
            finally:
                await coordinator.close()


@pytest.mark.timeout(60)
async def test_a_ps_address_that_is_a_workers_names_both_roles():

    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        spec = cluster.cluster_spec.as_dict()
        spec = {**spec, "ps": list(spec["worker"])}  # the ps entry is the worker's address
        strategy = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=TOKEN))
        try:
            with strategy.scope():
                pstrain.Variable(1.0, name="v")
            with pytest.raises(WrongTaskError) as info:
                await strategy.flush()
            message = str(info.value)
            assert "/job:worker/replica:0/task:0" in message and "not /job:ps/replica:0/task:0" in message
            assert "has no operation" not in message
        finally:
            await strategy.channels.close()


@pytest.mark.timeout(60)
async def test_closures_waiting_for_an_unreachable_worker_say_so_at_once(caplog):

    with socket.socket() as nobody:  # bound, never listening
        nobody.bind(("127.0.0.1", 0))
        wrong = f"127.0.0.1:{nobody.getsockname()[1]}"
        async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
            spec = {**cluster.cluster_spec.as_dict(), "worker": [wrong]}
            strategy = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=TOKEN))
            coordinator = pstrain.ClusterCoordinator(strategy, no_worker_timeout_s=4.0)
            try:
                with caplog.at_level(logging.WARNING, logger="pstrain._coordinator.heartbeat"):
                    rv = coordinator.schedule(lambda: 1)
                    await wait_for(
                        lambda: "no worker is reachable" in caplog.text,
                        timeout=3,
                        what="the wait announced, well before the 4 s limit",
                    )
                    assert "waiting up to 4 s (no_worker_timeout_s)" in caplog.text
                    assert f'cluster["worker"][0] = "{wrong}"' in caplog.text, caplog.text
                    with pytest.raises(CancelledError, match="no worker has been reachable"):
                        await rv
                    with pytest.raises(UnavailableError):
                        await coordinator.join()
            finally:
                await coordinator.close()
