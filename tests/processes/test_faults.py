"""Preemption drills with real processes: workers killed and restarted, a ps lost and restored."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from pstrain.errors import UnavailableError
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, wait_for


@pytest.fixture
def cluster(process_cluster):
    """Fault drills kill real processes."""
    return process_cluster


pytestmark = pytest.mark.timeout(120)


async def setup(cluster, **kw):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, **kw)
    async with strategy.scope():
        count = pstrain.Variable(0, name="count")
    return strategy, coordinator, count


def make_step(count, delay=0.0):
    async def step():
        if delay:
            await asyncio.sleep(delay)
        await count.assign_add(1)
        return 1

    return step


async def test_kill_between_closures_then_restart_counts_exactly(cluster):
    _, coordinator, count = await setup(cluster)
    step = make_step(count)
    for _ in range(2):
        coordinator.schedule(step)
    await coordinator.join()
    # worker 1 may have run both closures before worker 0 was first reached: a worker
    # never reached is not lost when its process goes (no failure counts), so wait
    await wait_for(lambda: coordinator.workers_up == [True, True], what="both workers up")
    await cluster.kill("worker", 0)
    await cluster.restart("worker", 0)
    for _ in range(20):
        coordinator.schedule(step)
    await coordinator.join()
    assert await count.numpy() == 22
    # worker 0's first closure after the restart met a new process: the loss was seen
    assert coordinator.worker_failures >= 1
    await wait_for(lambda: coordinator.workers_up == [True, True], what="worker 0 to be back")
    await coordinator.close()


async def test_kill_in_the_middle_of_200_closures(cluster):
    _, coordinator, count = await setup(cluster, max_inflight_per_worker=4)
    rvs = [coordinator.schedule(make_step(count, 0.01)) for _ in range(200)]
    await wait_for(lambda: count.numpy(), what="training to start")
    await wait_for(lambda: _at_least(count, 40), what="some progress")
    await cluster.kill("worker", 1)
    await coordinator.join()
    assert all(rv.done() for rv in rvs)
    assert [await rv for rv in rvs] == [1] * 200  # every closure ran (at least once)
    assert await count.numpy() >= 200
    assert coordinator.worker_failures >= 1
    assert coordinator.closures_retried >= 1  # it had closures in flight: they ran elsewhere
    await coordinator.close()


async def _at_least(var, n):
    return await var.numpy() >= n


async def test_both_workers_killed_and_restarted(cluster):
    _, coordinator, count = await setup(cluster)
    for _ in range(100):
        coordinator.schedule(make_step(count, 0.01))
    await wait_for(lambda: _at_least(count, 10), what="progress")
    await wait_for(lambda: coordinator.workers_up == [True, True], what="both workers up")
    await cluster.kill("worker", 0)
    await cluster.kill("worker", 1)
    await cluster.restart("worker", 0)
    await cluster.restart("worker", 1)
    await coordinator.join()
    assert await count.numpy() >= 100
    assert coordinator.worker_failures >= 2  # each worker's loss was seen
    await coordinator.close()


async def test_one_worker_killed_twice_in_a_row(cluster):
    _, coordinator, count = await setup(cluster)
    for _ in range(300):
        coordinator.schedule(make_step(count, 0.01))
    for _ in range(2):
        # kill it while it runs closures, so that each loss is seen
        await wait_for(
            lambda: coordinator.workers_up[0] and coordinator.queue.in_flight_on(0) > 0,
            what="worker 0 to run closures",
        )
        await cluster.kill("worker", 0)
        await cluster.restart("worker", 0)
    await coordinator.join()
    assert await count.numpy() >= 300
    assert coordinator.worker_failures >= 2
    await coordinator.close()


async def test_a_worker_that_stays_down(cluster):
    _, coordinator, count = await setup(cluster)
    for _ in range(60):
        coordinator.schedule(make_step(count, 0.005))
    await wait_for(lambda: _at_least(count, 5), what="progress")
    # kill it while it runs a closure: a worker never reached, or idle with nothing left to
    # run, is not found unreachable
    await wait_for(
        lambda: coordinator.workers_up == [True, True] and coordinator.queue.in_flight_on(1) > 0,
        what="worker 1 to run closures",
    )
    await cluster.kill("worker", 1)
    await coordinator.join()
    assert await count.numpy() >= 60
    assert coordinator.worker_failures == 1 and coordinator.workers_up == [True, False]
    await coordinator.close()


async def test_restarted_workers_iterator_is_rebuilt(drill):
    cluster = await drill.cluster(num_ps=1, num_workers=1)
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    it = iter(coordinator.create_per_worker_dataset(lambda: pstrain.data.Dataset.range(1000)))
    first = [int(await coordinator.schedule(lambda it: next(it), args=(it,))) for _ in range(3)]
    assert first == [0, 1, 2]
    await cluster.kill("worker", 0)
    await cluster.restart("worker", 0)
    again = int(await coordinator.schedule(lambda it: next(it), args=(it,)))
    assert again == 0  # rebuilt on the new process, from the beginning
    await coordinator.close()


async def test_results_stay_readable_after_their_worker_died(drill):
    cluster = await drill.cluster(num_ps=1, num_workers=1)
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    rv = coordinator.schedule(lambda: {"value": np.arange(3)})
    await coordinator.join()
    await cluster.kill("worker", 0)
    np.testing.assert_array_equal((await rv)["value"], [0, 1, 2])
    got = []
    thread = threading.Thread(target=lambda: got.append(rv.fetch()))
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
    np.testing.assert_array_equal(got[0]["value"], [0, 1, 2])
    await coordinator.close()


async def test_ps_loss_is_reported_then_restored_from_a_checkpoint(tmp_path, drill):
    cluster = await drill.cluster(num_ps=2, num_workers=2, checkpoint_root=tmp_path)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, ps_timeout_s=5.0)
    async with strategy.scope():
        w = pstrain.Variable(np.zeros(4, np.float32), name="w")  # ps 0
        table = pstrain.Variable(np.zeros((50, 4), np.float32), name="table")  # ps 1
        opt = pstrain.optimizers.Adagrad(0.1)
    manager = CheckpointManager(Checkpoint(w=w, table=table, optimizer=opt), str(tmp_path))

    async def step():
        await opt.apply_gradients(
            [(np.ones(4, np.float32), w), (pstrain.IndexedSlices(np.ones((2, 4)), [1, 7]), table)]
        )

    for _ in range(10):
        coordinator.schedule(step)
    await coordinator.join()
    path = await manager.save()
    saved = load_variables(path)

    await cluster.kill("ps", 1)
    t = time.monotonic()
    for _ in range(5):
        coordinator.schedule(step)
    with pytest.raises(UnavailableError) as info:
        await coordinator.join()
    assert time.monotonic() - t < 30
    assert "/job:ps/replica:0/task:1" in str(info.value) + str(info.value.task)
    assert str(info.value).count("schedule the failed work again") == 1, str(info.value)

    before = coordinator.ps_incarnations[1]
    await cluster.restart("ps", 1)
    # The heartbeat sees the new incarnation first (its "restarted" error is pending);
    # the restore onto that incarnation then makes it moot: work goes on.
    await wait_for(
        lambda: coordinator.ps_incarnations[1] not in (None, before),
        timeout=30,
        what="the restarted ps seen",
    )
    await Checkpoint(w=w, table=table, optimizer=opt).restore(manager.latest_checkpoint)
    for name, var in (("w", w), ("table", table)):
        assert (await var.numpy()).tobytes() == saved[name].tobytes()  # bit for bit
    assert await opt.iterations.numpy() == 10
    for _ in range(5):
        coordinator.schedule(step)
    await coordinator.join()
    assert await opt.iterations.numpy() == 15
    await coordinator.close()


@pytest.mark.parametrize("framework", ["numpy", "jax"])
def test_fault_drill_example_accounts_for_every_step(framework):

    example = Path(__file__).resolve().parents[2] / "examples" / "fault_drill.py"
    result = subprocess.run(
        [sys.executable, str(example), "--steps", "120", "--quiet", "--framework", framework],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


async def _equals(variable, value: float) -> bool:
    return bool(await variable.numpy() == value)


async def test_a_draining_worker_says_so_with_its_results_so_its_going_is_no_failure(tmp_path):
    # The worker leaves once its last results are out. A batch the coordinator sent before it
    # read them used to find the worker gone: counted as a failure (seen under load). The
    # results of a draining worker now say so: the coordinator sends it nothing more.

    async with InProcessCluster(num_ps=1, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
        async with strategy.scope():
            count = pstrain.Variable(0.0, name="count")
            started = pstrain.Variable(0.0, name="started")
        gate = str(tmp_path / "gate")
        os.mkfifo(gate)  # a read of it waits for the test to write: the closures wait on it
        opened = os.open(gate, os.O_RDWR)  # the test's end (never blocks, keeps it open)

        def wait_for_the_gate() -> None:
            with open(gate, "rb", buffering=0) as f:
                f.read(1)  # one byte each

        async def held():
            await started.assign_add(1.0)
            await asyncio.to_thread(wait_for_the_gate)
            return pstrain.get_current_worker_index()

        try:
            first = [coordinator.schedule(held) for _ in range(4)]
            await wait_for(lambda: _equals(started, 4.0), timeout=30, what="two closures on each worker")
            cluster.workers[1].begin_drain()  # what SIGTERM does
            os.write(opened, b"go" * 2)  # a byte for each of the four
            await wait_for(lambda: all(rv.done() for rv in first), timeout=30, what="the first four")
            slot = coordinator.membership()[1]  # told as its results came back: draining, or left
            assert slot["state"] in ("draining", "lost") and slot["failures"] == 0, slot
            rest = [coordinator.schedule(lambda: count.assign_add(1.0)) for _ in range(20)]
            await coordinator.join()
            assert sorted([await rv for rv in first]) == [0, 0, 1, 1]
            assert await count.numpy() == 20.0 and all(rv.done() for rv in rest)
            assert cluster.workers[1].closures_run == 2  # nothing new went to the draining worker
            assert coordinator.worker_failures == 0 and coordinator.closures_retried == 0
            await coordinator.close()
        finally:
            os.close(opened)


async def test_a_worker_drained_by_sigterm_leaves_with_nothing_lost_and_no_failure(drill):

    cluster = await drill.cluster(num_ps=1, num_workers=2)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=4)
    async with strategy.scope():
        count = pstrain.Variable(0.0, name="count")

    async def incr():
        await asyncio.sleep(0.03)  # the closure's work: some are in flight at the SIGTERM
        await count.assign_add(1.0)
        return pstrain.get_current_worker_index()

    rvs = [coordinator.schedule(incr) for _ in range(150)]
    await wait_for(lambda: sum(rv.done() for rv in rvs) >= 30, timeout=30, what="30 done")
    pid = cluster.pid("worker", 1)
    os.kill(pid, signal.SIGTERM)  # a spot machine's preemption notice
    await coordinator.join()
    ran_on = [await rv for rv in rvs]  # every closure resolved
    assert await count.numpy() == 150.0  # each ran exactly once: drained, not killed
    assert coordinator.worker_failures == 0 and coordinator.closures_retried == 0
    assert ran_on.count(1) > 0 and ran_on[-1] == 0  # worker 1 took work, then handed it on
    await wait_for(lambda: cluster.pid("worker", 1) is None, timeout=30, what="worker 1 gone")
    await coordinator.close()


async def test_a_worker_sigterm_while_idle_is_heard_at_the_next_batch_not_counted_a_failure(drill):
    """SIGTERM with nothing running on the worker: no reply has told the coordinator it is
    leaving, so it waits (refusing work) until the next batch hears it."""

    cluster = await drill.cluster(num_ps=1, num_workers=2)
    _, coordinator, count = await setup(cluster, max_inflight_per_worker=2)

    async def incr():
        await count.assign_add(1)
        return pstrain.get_current_worker_index()

    # until both workers have run closures (on a loaded machine one may take a whole batch):
    # then worker 1 is idle, its connection open
    seen: set[int] = set()
    warmed = 0
    deadline = time.monotonic() + 60
    while seen != {0, 1}:
        assert time.monotonic() < deadline, f"only workers {seen} ran closures"
        warm = [coordinator.schedule(incr) for _ in range(20)]
        await coordinator.join()
        seen |= {await rv for rv in warm}
        warmed += 20
    peers = rpc.ChannelPool(cluster.cluster_spec, cluster.token)

    async def draining_or_gone():
        try:
            return (await peers.channel("worker", 1).statistics())["draining"]
        except pstrain.errors.UnavailableError:
            return True  # gone at once (what happened before): the batch below shows it

    try:
        os.kill(cluster.pid("worker", 1), signal.SIGTERM)
        await wait_for(draining_or_gone, timeout=30, what="worker 1 draining")
        rest = [coordinator.schedule(incr) for _ in range(20)]
        await coordinator.join()
        assert [await rv for rv in rest] == [0] * 20
        assert await count.numpy() == warmed + 20
        assert coordinator.worker_failures == 0 and coordinator.closures_retried == 0
        await wait_for(lambda: cluster.pid("worker", 1) is None, timeout=30, what="worker 1 gone")
        assert coordinator.membership()[1]["failures"] == 0
    finally:
        await peers.close()
    await coordinator.close()


async def test_a_worker_joins_a_running_job_at_a_new_address_and_takes_work_within_5_s(drill):

    cluster = await drill.cluster(num_ps=1, num_workers=2)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=2)
    endpoint = await coordinator.serve_metrics()
    async with strategy.scope():
        count = pstrain.Variable(0.0, name="count")
    it = iter(coordinator.create_per_worker_dataset(lambda: iter(range(10**6))))

    async def incr(it):
        await asyncio.sleep(0.01)  # the closure's work (its duration, not a wait)
        await count.assign_add(1.0)
        return pstrain.get_current_worker_index(), next(it)

    await coordinator.schedule(incr, args=(it,))
    await cluster.kill("worker", 1)  # preempted for good; its replacement comes elsewhere
    rvs = [coordinator.schedule(incr, args=(it,)) for _ in range(20)]
    await coordinator.join()
    await wait_for(lambda: not coordinator.workers_up[1], timeout=30, what="worker 1 seen gone")
    old = coordinator.membership()[1]["address"]
    joiner = drill.serve("--role", "worker", "--port", "0", "--join", endpoint, token=cluster.token)
    started = time.monotonic()
    await wait_for(lambda: coordinator.workers_up[1], timeout=5, what="the joiner up")
    more = [coordinator.schedule(incr, args=(it,)) for _ in range(40)]
    await coordinator.join()
    assert 1 in {(await rv)[0] for rv in more}  # it takes closures as worker 1
    assert time.monotonic() - started < 5
    member = coordinator.membership()[1]
    assert member["up"] and member["address"] == joiner.address != old
    assert await count.numpy() == 1 + len(rvs) + 40

    # Every slot is up: a third worker grows the cluster, with its own dataset.
    grower = drill.serve("--role", "worker", "--port", "0", "--join", endpoint, token=cluster.token)
    started = time.monotonic()
    await wait_for(
        lambda: len(coordinator.workers_up) == 3 and coordinator.workers_up[2],
        timeout=5,
        what="the cluster grown to 3 workers",
    )
    late = [coordinator.schedule(incr, args=(it,)) for _ in range(60)]
    await coordinator.join()
    on_2 = [(await rv)[1] for rv in late if (await rv)[0] == 2]
    assert on_2 and on_2 == list(range(len(on_2)))  # its own iterator, from the start
    assert time.monotonic() - started < 5
    assert strategy.num_workers == 3 and len(it.values) == 3
    assert [m["address"] for m in coordinator.membership()][2] == grower.address
    assert await count.numpy() == 1 + len(rvs) + 40 + 60
    assert coordinator.worker_failures == 1  # the preempted worker only
    config = json.dumps({"cluster": cluster.cluster_spec.as_dict()})
    status = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: subprocess.run(
            [sys.executable, "-m", "pstrain", "status", "--coordinator", endpoint],
            capture_output=True,
            text=True,
            timeout=60,
            env={
                **os.environ,
                "PSTRAIN_CONFIG": config,
                "PSTRAIN_TOKEN": cluster.token,
            },
        ),
    )
    assert f"worker 1  up       {joiner.address}" in status.stdout, status.stdout + status.stderr
    assert f"worker 2  up       {grower.address}" in status.stdout, status.stdout + status.stderr
    assert "placement map version 0" in status.stdout, status.stdout
    assert f"ps 0  in   {cluster.cluster_spec.job_tasks('ps')[0]}" in status.stdout, status.stdout
    await coordinator.close()


async def test_a_connection_attempt_whose_callers_were_cancelled_is_not_handed_to_the_next():
    """A step cancelled while its channel was connecting to a ps that was down left the
    attempt behind; its failure ("connection refused") was handed to the first step after
    the ps came back. Each call after an attempt ended makes its own."""

    listener = socket.socket()  # accepts connections (the kernel's backlog), never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    ch = rpc.Channel(
        f"127.0.0.1:{listener.getsockname()[1]}", token="t" * 32, task="ps0", connect_timeout=0.5
    )
    accepted = []

    def connection_waiting() -> bool:
        if select.select([listener], [], [], 0)[0]:
            accepted.append(listener.accept()[0])
        return bool(accepted)

    try:
        first = asyncio.ensure_future(ch.connected())
        await wait_for(connection_waiting, timeout=10, what="the first attempt's connection")
        first.cancel()  # the step waiting on it is cancelled: nobody awaits the attempt now
        await asyncio.gather(first, return_exceptions=True)
        conn = accepted.pop()
        conn.setblocking(False)

        def closed_by_client() -> bool:  # the attempt gave up on the handshake: it ended
            try:
                return conn.recv(65536) == b""
            except BlockingIOError:
                return False
            except ConnectionResetError:
                return True

        await wait_for(closed_by_client, timeout=10, what="the first attempt to end")
        conn.close()
        second = asyncio.ensure_future(ch.connected())
        await wait_for(
            connection_waiting, timeout=10, what="a new attempt (not the first one's failure handed back)"
        )
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
    finally:
        for c in accepted:
            c.close()
        listener.close()
        await ch.close()


async def test_a_call_cancelled_just_as_its_connection_is_made_stays_cancelled(ps_server):
    """A coordinator's close() hung, rarely, when it cancelled a worker's dispatcher just as
    the dispatcher's channel reconnected to a restarted worker: Python 3.11's wait_for, under
    the connect, returned the connection and dropped the cancel, and the dispatcher went on
    to wait for work forever. The cancel here arrives in the very step the connection is
    made (real server, real connection)."""

    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    connect = ch.connected
    caller: list[asyncio.Task] = []

    async def connected_then_cancelled():
        proto = await connect()
        caller[0].cancel()  # the caller's cancel, in the step the connection is made
        return proto

    ch.connected = connected_then_cancelled  # type: ignore[method-assign]
    try:
        call = asyncio.ensure_future(ch.health(timeout=10.0))
        caller.append(call)
        with pytest.raises(asyncio.CancelledError):
            await call
        assert call.cancelled()
    finally:
        await ch.close()


async def test_a_ps_that_fails_while_a_worker_recovers_fails_join_with_unavailable(cluster):
    """TF's testPSFailureWhileRecoveryFromWokerFailure: a worker and a ps are killed at
    once and started again (the ps empty) while closures run; join raises UnavailableError
    (TF accepts it or InvalidArgumentError), never a NotFoundError of the lost variables.
    The heartbeat is slowed down: the closures meet the restarted ps first."""
    strategy, coordinator, count = await setup(cluster, heartbeat_s=30.0)
    with strategy.scope():
        others = [pstrain.Variable(np.zeros(4, np.float32), name=f"v{i}") for i in range(3)]

    async def step():
        await asyncio.sleep(0.01)  # the step's work: the kills land while steps run
        for v in [count, *others]:
            await v.assign_add(np.ones(v.shape, v.dtype.name) if v.shape else 1)

    for _ in range(20):
        coordinator.schedule(step)
    await coordinator.join()
    await wait_for(lambda: coordinator.workers_up == [True, True], what="both workers up")
    stop = asyncio.Event()

    async def keep_scheduling() -> BaseException | None:
        while not stop.is_set():
            try:
                coordinator.schedule(step)
            except pstrain.errors.PstrainError as exc:
                return exc  # raised here, it is not raised again by join
            await asyncio.sleep(0.005)  # the pace new work arrives at (not a wait for anything)
        return None

    feeder = asyncio.ensure_future(keep_scheduling())
    await asyncio.gather(cluster.kill("worker", 0), cluster.kill("ps", 0))
    await asyncio.gather(cluster.restart("worker", 0), cluster.restart("ps", 0))
    raised: BaseException | None = None
    try:  # the next schedule or join raises it (TF): the feeder's schedule, or this join
        await asyncio.wait_for(coordinator.join(), 60)
    except pstrain.errors.PstrainError as exc:
        raised = exc
    stop.set()
    raised = raised or await feeder
    assert isinstance(raised, (UnavailableError, pstrain.errors.InvalidArgumentError)), repr(raised)
    assert not isinstance(raised, pstrain.errors.NotFoundError), repr(raised)
    await coordinator.close()


async def test_a_silent_ps_is_reported_with_its_advice_said_once():

    async with InProcessCluster(num_ps=2, num_workers=1) as in_process:
        strategy = pstrain.ParameterServerStrategy(in_process.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0, name="v")
        await v.read_value()
        release = asyncio.Event()

        async def busy():
            await release.wait()

        coordinator.schedule(busy)  # closures run: a silent ps is the job's error
        await wait_for(lambda: coordinator.queue.in_flight, what="the closure running")
        await in_process.ps[1].stop()
        error = await coordinator.heartbeat.ps_restarted(1, report_silence=True)
        release.set()
        assert isinstance(error, UnavailableError) and "unreachable" in str(error)
        assert str(error).count("schedule the failed work again") == 1, str(error)
        assert str(error).count("If the ps restarted") + str(error).count("if it restarted") == 1
        await coordinator.close()
