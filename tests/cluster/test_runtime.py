"""The runtime's small parts without a cluster: the blocking bridge, task ownership, placement,
RemoteValue, and the in-process cluster's leak check."""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

import pstrain
from pstrain._base.tasks import TaskOwner
from pstrain._coordinator.remote_value import Outcome, RemoteValue
from pstrain._transport.bridge import block_on, new_event_loop
from pstrain._variables.placement import Placement
from pstrain.errors import DeadlineExceededError, PstrainError
from pstrain.testing import InProcessCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(20)

_var: contextvars.ContextVar[str] = contextvars.ContextVar("test_var", default="unset")


class LoopThread:
    """An event loop running in a thread of its own, as the coordinator's or a worker's."""

    def __enter__(self) -> asyncio.AbstractEventLoop:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self.loop

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


# -- the blocking bridge ---------------------------------------------------------------------------
def test_block_on_runs_on_the_given_loop_in_the_callers_context():
    async def where() -> tuple[str, bool]:
        return _var.get(), threading.current_thread() is not threading.main_thread()

    with LoopThread() as loop:
        token = _var.set("caller's")
        try:
            assert block_on(where, loop) == ("caller's", True)
        finally:
            _var.reset(token)


def cancellable() -> tuple[threading.Event, Callable[[], Awaitable[None]]]:
    """A coroutine function that waits forever, and an event set when it is cancelled."""
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return cancelled, forever


def test_block_on_times_out_with_deadline_exceeded_and_cancels_the_work():
    cancelled, forever = cancellable()
    with LoopThread() as loop:
        t = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="within 0.1 s") as info:
            block_on(forever, loop, timeout=0.1)
        assert isinstance(info.value, TimeoutError) and time.monotonic() - t < 5
        assert cancelled.wait(5)


async def test_block_on_refuses_a_thread_that_runs_a_loop():
    with pytest.raises(RuntimeError, match="use 'await' here instead"):
        block_on(lambda: asyncio.sleep(0), asyncio.get_running_loop())


def test_block_on_without_a_loop_runs_one_here_and_propagates_errors():
    async def boom() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        block_on(boom)
    assert pstrain.run(asyncio.sleep(0, result=5)) == 5


async def test_pstrain_run_refuses_a_running_loop_without_leaving_a_coroutine_behind():
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already running"):
        pstrain.run(coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning


def test_pstrain_run_given_a_function_instead_of_its_coroutine_says_to_call_it():
    async def train():
        return 3

    with pytest.raises(
        TypeError,
        match=r"needs a coroutine, got <function .*train.*: call it, "
        r"pstrain.run\(train\(\)\)",
    ):
        pstrain.run(train)
    with pytest.raises(TypeError, match="needs a coroutine, got 5$"):
        pstrain.run(5)
    assert pstrain.run(train()) == 3


def test_ctrl_c_while_blocked_cancels_the_work():
    cancelled, forever = cancellable()

    # Python's own Ctrl-C handler, even where the shell started us with SIGINT ignored
    # (a backgrounded job): this is about block_on, not about the shell.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with LoopThread() as loop:
            # Deliver a KeyboardInterrupt to the waiting thread the way Ctrl-C does: SIGINT.
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                block_on(forever, loop)
            timer.join()
            assert cancelled.wait(5)
    finally:
        signal.signal(signal.SIGINT, previous)


# -- RemoteValue -------------------------------------------------------------------------------------
def test_fetch_from_a_thread_beside_await():
    with LoopThread() as loop:
        outcome = Outcome(loop)
        rv = RemoteValue(outcome)
        got = []
        reader = threading.Thread(target=lambda: got.append(rv.fetch(timeout=5)))
        reader.start()
        loop.call_soon_threadsafe(outcome.set_value, 11)
        reader.join(5)
        assert got == [11] and rv.done()
        assert block_on(rv.get, loop) == 11
        with pytest.raises(DeadlineExceededError):
            RemoteValue(Outcome(loop)).fetch(timeout=0.05)


# -- task ownership ----------------------------------------------------------------------------------
async def test_task_owner_reports_failures_and_cancels_on_close():
    failures: list[BaseException] = []
    owner = TaskOwner("test", on_failure=failures.append)

    async def fail() -> None:
        raise ValueError("seen")

    await asyncio.gather(owner.spawn(fail()), return_exceptions=True)
    assert [str(e) for e in failures] == ["seen"] and owner.failures == 1
    observed = owner.spawn(fail(), observed=True)
    with pytest.raises(ValueError):
        await observed
    assert owner.failures == 1  # its awaiter handled it
    sleeper = owner.spawn(asyncio.sleep(60))
    await owner.close()
    assert sleeper.cancelled() and len(owner) == 0
    with pytest.raises(PstrainError, match="closed"):
        owner.spawn(asyncio.sleep(0))


# -- placement -----------------------------------------------------------------------------------------
def test_placement_names_round_robin_colocation_and_partitioning():
    p = Placement(num_ps=3, channels=None, partitioner=pstrain.partitioners.FixedShardsPartitioner(2))
    with p.scope():
        a = pstrain.Variable(1.0, name="a")
        b = pstrain.Variable(2.0, name="a")
        table = pstrain.Variable(np.zeros((5, 2)), name="t")
        with p.colocated(0):
            c = pstrain.Variable(np.zeros((4, 2)), name="c")  # colocated: never partitioned
    assert (a.name, b.name) == ("a", "a_1")
    assert [a.ps_index, b.ps_index] == [0, 1]
    assert [v.name for v in table.variables] == ["t/part_0", "t/part_1"]
    assert [v.shape for v in table.variables] == [(3, 2), (2, 2)]
    assert [v.ps_index for v in table.variables] == [2, 0]
    assert c.ps_index == 0 and not hasattr(c, "variables")
    assert p.issued == 5 and p.created_upto == 0 and not a.is_created()
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="no ps 3"):
        with p.colocated(3):
            pass


async def test_many_concurrent_ensure_created_calls_make_one_request_per_ps_and_never_spin():
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        placement = strategy.placement
        with strategy.scope():  # a plain `with`: nothing is sent yet
            vs = [pstrain.Variable(float(i), name=f"v{i}") for i in range(10)]
        # Twenty concurrent callers, and more variables created while the first send runs.
        callers = [asyncio.ensure_future(placement.ensure_created()) for _ in range(20)]
        await wait_for(
            lambda: any("vars/create" in s.stats for s in cluster.ps),
            what="the first creations to reach a ps",
        )
        with strategy.scope():
            late = pstrain.Variable(99.0, name="late")
        callers.append(asyncio.ensure_future(placement.ensure_created()))
        await asyncio.wait_for(asyncio.gather(*callers), 10)
        assert placement.created_upto == placement.issued == 11
        assert all(v.is_created() for v in [*vs, late])
        creates = [s.statistics(None)["requests"]["vars/create"]["count"] for s in cluster.ps]
        assert sum(creates) <= 4  # one per ps for the first batch, one for the late variable
        assert await late.numpy() == 99.0


async def test_two_workers_a_ps_and_a_coordinator_share_one_process():
    async with InProcessCluster(num_ps=1, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0)

        async def step() -> int:
            await v.assign_add(1.0)
            return pstrain.get_current_worker_index()

        seen = {await coordinator.schedule(step) for _ in range(20)}
        await coordinator.join()
        assert seen <= {0, 1} and await v.numpy() == 20.0
        with pytest.raises(RuntimeError, match="non-dispatched"):
            pstrain.get_current_worker_index()  # the coordinator is not a worker
        await coordinator.close()
