"""The scheduling core without any process, socket or task: TF's ClusterCoordinator semantics.

These drive :class:`pstrain._coordinator.scheduling.ClosureQueue` and
:class:`pstrain._coordinator.resources.ResourceRegistry` directly, as a dispatcher would.
"""

from __future__ import annotations

import asyncio

import pytest

from pstrain._coordinator.closures import Closure, scan_inputs
from pstrain._coordinator.remote_value import Outcome, RemoteValue
from pstrain._coordinator.resources import ResourceRegistry, WorkerResource
from pstrain._coordinator.scheduling import ClosureQueue
from pstrain._distribute.values import PerWorkerValues
from pstrain._formats.messages.closures import ResourceRef
from pstrain.errors import CancelledError, ClosureInputError

pytestmark = pytest.mark.timeout(10)


def closure(cid: int, *args, **kwargs) -> Closure:
    inputs: list = []
    walk = scan_inputs(args, inputs) | scan_inputs(kwargs, inputs)
    return Closure(cid, None, b"d", b"", tuple(args), kwargs, Outcome(), walk=walk, inputs=inputs)


def result(c: Closure):
    """The closure's outcome, raised if it failed."""
    assert c.outcome.done(), f"closure {c.cid} is not resolved"
    return c.outcome.result()


def test_fifo_take_respects_the_limit_and_counts_per_worker():
    q = ClosureQueue()
    cs = [closure(i) for i in range(1, 6)]
    for c in cs:
        q.put(c)
    assert [c.cid for c in q.take(0, 2)] == [1, 2]
    assert [c.cid for c in q.take(1, 10)] == [3, 4, 5]
    assert (q.queued, q.in_flight, q.in_flight_on(0), q.in_flight_on(1)) == (0, 5, 2, 3)
    assert q.take(0, 5) == []
    assert q.finish(1, "a") and result(cs[0]) == "a"
    assert q.in_flight_on(0) == 1 and q.done_count == 1
    assert not q.finish(1, "again")  # resolves once


def test_first_error_wins_and_cancels_what_is_queued():
    q = ClosureQueue()
    cs = [closure(i) for i in range(1, 6)]
    for c in cs:
        q.put(c)
    q.take(0, 1)  # 1 on worker 0
    q.take(1, 2)  # 2, 3 on worker 1
    assert q.fail(2, KeyError("first"))
    assert q.fail(3, ValueError("second"))  # also fails its own RemoteValue ...
    assert isinstance(q.error, KeyError)  # ... but the first error is the one kept
    with pytest.raises(ValueError):
        result(cs[2])
    for c in cs[3:]:  # queued: cancelled at once
        with pytest.raises(CancelledError, match="cancelled"):
            result(c)
    assert q.queued == 0
    # the worker still running closure 1 is asked to cancel it; the other has nothing left
    assert q.take_cancellations(0) == [1] and q.take_cancellations(1) == []


def test_take_error_clears_it_and_abandons_what_is_in_flight():
    q = ClosureQueue()
    cs = [closure(i) for i in range(1, 4)]
    for c in cs:
        q.put(c)
    q.take(0, 3)
    q.fail(1, RuntimeError("boom"))
    error = q.take_error()
    assert isinstance(error, RuntimeError) and q.error is None
    assert q.take_error() is None  # raised once
    for c in cs[1:]:
        with pytest.raises(CancelledError):
            result(c)
    assert q.is_idle()
    assert not q.finish(2, "late")  # a late result of an abandoned closure is ignored
    with pytest.raises(CancelledError):
        result(cs[1])
    # the coordinator keeps working
    c = closure(9)
    q.put(c)
    q.take(0, 1)
    q.finish(9, 42)
    assert result(c) == 42 and q.is_idle()


def test_a_cancelled_closure_is_not_an_error():
    q = ClosureQueue()
    c = closure(1)
    q.put(c)
    q.take(0, 1)
    q.fail(1, CancelledError("cancelled on its worker"), cancelled=True)
    assert q.error is None
    with pytest.raises(CancelledError):
        result(c)


def test_put_back_on_worker_loss_keeps_order_and_runs_elsewhere():
    q = ClosureQueue()
    cs = [closure(i) for i in range(1, 6)]
    for c in cs:
        q.put(c)
    q.take(0, 2)  # 1, 2 on worker 0
    q.take(1, 1)  # 3 on worker 1
    assert q.put_back(0) == 2
    assert q.retried_count == 2 and q.in_flight_on(0) == 0 and q.in_flight == 1
    assert [c.cid for c in q.take(1, 10)] == [1, 2, 4, 5]  # back at the front, in order
    for cid in (1, 2, 3, 4, 5):
        q.finish(cid, cid)
    assert [result(c) for c in cs] == [1, 2, 3, 4, 5]


def test_put_back_while_an_error_is_pending_cancels():
    q = ClosureQueue()
    cs = [closure(1), closure(2)]
    for c in cs:
        q.put(c)
    q.take(0, 1)
    q.take(1, 1)
    q.fail(2, RuntimeError("boom"))
    q.put_back(0)
    with pytest.raises(CancelledError):
        result(cs[0])
    assert q.retried_count == 0 and q.queued == 0


def test_scheduled_from_another_thread_while_an_error_is_pending_is_cancelled():
    q = ClosureQueue()
    q.put(closure(1))
    q.take(0, 1)
    q.fail(1, RuntimeError("boom"))
    late = closure(2)
    q.put_cancelled_if_error(late)
    with pytest.raises(CancelledError):
        result(late)


def test_listeners_are_woken_by_work_and_errors():
    q = ClosureQueue()
    wakes: list[int] = []
    q.add_listener(lambda: wakes.append(1))
    q.put(closure(1))
    assert wakes == [1]
    q.take(0, 1)
    q.record_error(RuntimeError("x"))
    assert len(wakes) == 2


async def test_wait_idle_and_wait_drained():
    q = ClosureQueue()
    await q.wait_idle()  # idle: returns at once
    q.put(closure(1))
    q.put(closure(2))
    # Drive the waiting coroutine by hand: it stops at the future it waits on.
    waiting = q.wait_idle()
    blocker = waiting.send(None)
    assert not blocker.done()
    q.take(0, 2)
    q.finish(1, None)
    assert not blocker.done()  # one closure still in flight
    q.finish(2, None)
    assert blocker.done()
    with pytest.raises(StopIteration):
        waiting.send(None)  # and it returns
    # an error ends wait_idle even with work in flight; wait_drained waits for the in-flight
    q.put(closure(3))
    q.put(closure(4))
    q.take(0, 2)
    q.fail(3, RuntimeError("x"))
    await asyncio.wait_for(q.wait_idle(), 1)
    assert not await q.wait_drained(timeout=0.01)
    q.fail(4, CancelledError("x"), cancelled=True)
    assert await q.wait_drained(timeout=1)


def test_remote_value_inputs_are_resolved_and_failed_inputs_fail_the_consumer():
    producer, bad = Outcome(), Outcome()
    good = closure(1, RemoteValue(producer), scale=3)
    assert good.walk and not good.inputs_ready()
    producer.set_value(7)
    assert good.inputs_ready()
    assert good.arguments_for(0) == ((7,), {"scale": 3}, False)
    failing = closure(2, [RemoteValue(bad)])
    bad.set_error(RuntimeError("producer failed"))
    with pytest.raises(ClosureInputError, match="producer failed"):
        failing.arguments_for(0)
    q = ClosureQueue()
    q.put(failing)
    q.take(0, 1)
    q.fail(failing.cid, ClosureInputError("producer failed"))
    with pytest.raises(ClosureInputError):
        result(failing)
    assert isinstance(q.error, ClosureInputError)


def test_a_consumer_of_a_failed_value_learns_why_even_when_cancelled():
    producer = Outcome()
    q = ClosureQueue()
    maker, consumer, other = closure(1), closure(2, RemoteValue(producer)), closure(3)
    for c in (maker, consumer, other):
        q.put(c)
    q.take(0, 1)
    producer.set_error(RuntimeError("producer failed"))
    q.fail(1, RuntimeError("producer failed"))  # cancels the queue
    with pytest.raises(ClosureInputError, match="producer failed"):
        result(consumer)
    with pytest.raises(CancelledError):
        result(other)


def test_per_worker_values_become_each_workers_part():
    values = PerWorkerValues(["a", "b"])
    resource = PerWorkerValues([None, None], resource_id=7)
    c = closure(1, values, (resource,))
    args0, _, refs0 = c.arguments_for(0)
    args1, _, _ = c.arguments_for(1)
    assert args0[0] == "a" and args1[0] == "b"
    assert isinstance(args0[1][0], ResourceRef) and args0[1][0].rid == 7 and refs0


def test_plain_arguments_are_not_walked():
    c = closure(1, 1, [2, {"x": 3}])
    assert not c.walk and c.arguments_for(0) == ((1, [2, {"x": 3}]), {}, False)


def test_resource_registry_builds_rebuilds_and_drops():
    reg = ResourceRegistry(num_workers=2)
    wakes: list[int] = []
    reg.add_listener(lambda: wakes.append(1))
    ds = reg.new("dataset", fn=list)
    it = reg.new("iterator", of=ds.rid, fn=list)
    assert [s.rid for s in reg.to_build(0)] == [ds.rid, it.rid] and wakes
    reg.built(0, ds, None)
    reg.built(0, it, {"type": "OSError", "message": "no data", "traceback": ""})
    assert isinstance(ds.outcomes[0].result(), WorkerResource)
    with pytest.raises(ClosureInputError, match="no data"):
        it.outcomes[0].result()
    assert reg.to_build(0) == []
    # the worker is lost, then comes back as the same process: nothing to rebuild
    reg.worker_lost(0)
    assert not ds.outcomes[0].done()
    reg.worker_reconnected(0)
    assert ds.outcomes[0].done() and reg.to_build(0) == []
    # ... or as a new process: everything is rebuilt, in creation order
    reg.worker_restarted(0)
    assert [s.rid for s in reg.to_build(0)] == [ds.rid, it.rid]
    # dropping: still pending on worker 1 -> no longer to build; built on 0 -> dropped there
    reg.built(0, ds, None)
    reg.drop(ds.rid)
    assert reg.take_dropped(0) == [ds.rid] and reg.take_dropped(0) == []
    assert [s.rid for s in reg.to_build(1)] == [it.rid] and reg.take_dropped(1) == []
