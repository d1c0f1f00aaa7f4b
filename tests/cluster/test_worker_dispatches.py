"""A worker runs one dispatch of its coordinator at a time, and answers while it loads one.

The coordinator declares a worker lost when it misses health checks with closures in
flight; it fences that dispatch (epoch) off every ps and sends the closures again,
under a newer epoch, once the worker answers. The worker may have been alive all along
(cut off, or busy importing torch for its first closure): its old closures must not run
beside the new ones, since they share the process (a ``torch.nn.Module`` a step pulls
into and takes gradients in). The fault matrix met it: both attempts of step 0 ran at
once on one worker, the rerun's embedding gradient doubled by the stale one's backward
(CI, seed 913843, torch). Real servers; the worker protocol as the coordinator speaks it.
"""

from __future__ import annotations

import asyncio
import sys
import threading

import cloudpickle
import pytest

import pstrain
from pstrain import rpc
from pstrain._formats.messages.closures import CANCELLED, OK
from pstrain.testing import untyped_call
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(60)

EVENTS: list[str] = []  # what the closures did, in order (they run in this process)
RELEASE = threading.Event()  # ends a plain closure that "computes" until it is set
_HERE = __name__  # closures find these here (a function sent by value carries no copy)


async def _runs_until_cancelled(name: str, forever: bool) -> str:
    here = sys.modules[_HERE]
    here.EVENTS.append(f"{name} start")
    try:
        if forever:
            await asyncio.Event().wait()  # never set: only a cancel ends it
    finally:
        here.EVENTS.append(f"{name} end")
    return name


def _computes(name: str, _: bool) -> str:  # a plain def closure: a cancel cannot stop it
    here = sys.modules[_HERE]
    here.EVENTS.append(f"{name} start")
    assert here.RELEASE.wait(30)
    here.EVENTS.append(f"{name} end")
    return name


ASYNC, SYNC = b"waits-0123456789", b"computes-0123456"
FNS = {ASYNC: cloudpickle.dumps(_runs_until_cancelled), SYNC: cloudpickle.dumps(_computes)}


def _run(
    ch: rpc.Channel,
    digest: bytes,
    name: str,
    forever: bool = False,
    *,
    epoch: int,
    owner: str = "coordinator-a",
    cid: int = 1,
) -> asyncio.Task:
    body = {
        "fns": FNS,
        "closures": [[cid, digest, (name, forever), {}, False]],
        "epoch": epoch,
        "owner": owner,
    }
    return asyncio.ensure_future(untyped_call(ch, "worker/run", body, pickle=True, timeout=20))


async def test_a_newer_dispatch_cancels_the_older_one_and_starts_once_it_ended(cluster):
    EVENTS.clear()
    ch = rpc.Channel(cluster.workers[0].address, token=cluster.token, task="w0")
    old = _run(ch, ASYNC, "old", True, epoch=1)
    await wait_for(lambda: "old start" in EVENTS, what="the old dispatch's closure to start")
    new = _run(ch, ASYNC, "new", epoch=2)  # the same closure (id 1), sent again
    assert (await new)["results"] == [[1, OK, "new"]]
    assert (await old)["results"] == [[1, CANCELLED, None]]
    assert EVENTS == ["old start", "old end", "new start", "new end"]

    # a batch of the old epoch arriving late is answered CANCELLED and never runs
    assert (await _run(ch, ASYNC, "late", epoch=1))["results"] == [[1, CANCELLED, None]]
    # epochs are per coordinator incarnation: another one's epoch 1 runs
    assert (await _run(ch, ASYNC, "other", epoch=1, owner="coordinator-b"))["results"] == [[1, OK, "other"]]
    assert EVENTS[4:] == ["other start", "other end"]
    await ch.close()


async def test_a_plain_closure_of_an_older_dispatch_runs_to_its_end_before_the_newer_starts(cluster):
    EVENTS.clear()
    RELEASE.clear()
    worker = cluster.workers[1]
    ch = rpc.Channel(worker.address, token=cluster.token, task="w1")
    old = _run(ch, SYNC, "old", epoch=3)
    await wait_for(lambda: "old start" in EVENTS, what="the old dispatch's closure to start")
    new = _run(ch, ASYNC, "new", epoch=4)
    await wait_for(
        lambda: worker._open_batches == 2 or "new start" in EVENTS, what="the worker to hold the new batch"
    )
    assert EVENTS == ["old start"]  # the new one waits for the old one
    RELEASE.set()
    assert (await new)["results"] == [[1, OK, "new"]]
    assert (await old)["results"] == [[1, OK, "old"]]  # it ran on (its updates are fenced)
    assert EVENTS == ["old start", "old end", "new start", "new end"]
    await ch.close()


async def test_closures_whose_coordinator_connection_ended_stop_before_the_next_ones_start(cluster):
    """A coordinator SIGKILLed (or one that found the worker unreachable) leaves closures
    running here; its successor's first batch must not run beside them."""
    EVENTS.clear()
    ch = rpc.Channel(cluster.workers[0].address, token=cluster.token, task="w0")
    old = _run(ch, ASYNC, "old", True, epoch=1, owner="coordinator-a")
    await wait_for(lambda: "old start" in EVENTS, what="the old coordinator's closure to start")
    await ch.close()  # its connection ends
    await wait_for(lambda: "old end" in EVENTS, what="the closure to be cancelled")
    with pytest.raises(pstrain.errors.PstrainError):
        await old
    ch = rpc.Channel(cluster.workers[0].address, token=cluster.token, task="w0")
    assert (await _run(ch, ASYNC, "next", epoch=1, owner="coordinator-b"))["results"] == [[1, OK, "next"]]
    assert EVENTS == ["old start", "old end", "next start", "next end"]
    await ch.close()


STRAGGLING = threading.Event()  # the straggler runs (until RELEASE is set)


def _straggler(v):  # a plain def closure: a cancel cannot stop it
    here = sys.modules[_HERE]
    here.STRAGGLING.set()
    here.RELEASE.wait(30)
    return v.assign_add(1.0)


def _fails():
    raise ValueError("a closure failed")


async def test_a_closure_still_running_after_the_cancel_grace_cannot_update_later(cluster):
    """The job's error cancels the closures in flight (their RemoteValues raise); one that
    runs on past ``cancel_grace_s`` has its dispatch fenced off every ps: its late update
    is refused (after the job restored a checkpoint, it would land on top of it)."""
    STRAGGLING.clear()
    RELEASE.clear()
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, cancel_grace_s=0.5)
    async with strategy.scope():
        v = pstrain.Variable(0.0, name="v")
    late = coordinator.schedule(_straggler, args=(v,))
    await wait_for(STRAGGLING.is_set, what="the straggler to run")
    coordinator.schedule(_fails)
    with pytest.raises(ValueError, match="a closure failed"):
        await coordinator.join()
    with pytest.raises(pstrain.errors.CancelledError):
        await late
    ended = sum(w.closures_run + w.closures_failed for w in cluster.workers)
    RELEASE.set()
    await wait_for(
        lambda: sum(w.closures_run + w.closures_failed for w in cluster.workers) > ended,
        what="the straggler to end",
    )
    assert float(await v.numpy()) == 0.0  # its update was refused
    assert max(s["epoch"] for s in coordinator.membership()) == 2  # its dispatch was given up
    # the job goes on: the next closures (a new epoch) update as usual
    for _ in range(4):
        coordinator.schedule(lambda v: v.assign_add(1.0), args=(v,))
    await coordinator.join()
    assert float(await v.numpy()) == 4.0
    await coordinator.close()
