"""The programming model end to end: strategy, coordinator, RemoteValue, on an in-process cluster."""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import time
import weakref

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain._formats.messages.closures import FUNCTION_BYTES_KEPT, FUNCTIONS_KEPT
from pstrain.errors import CancelledError, ClosureInputError, InvalidArgumentError, ProtocolError
from pstrain.testing import InProcessCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(90)


async def test_tf_documentation_example(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        v1 = pstrain.Variable(initial_value=0.0)
        v2 = pstrain.Variable(initial_value=1.0)

    async def worker_fn():
        await v1.assign_add(0.1)
        await v2.assign_sub(0.2)
        return await v1.read_value() / await v2.read_value()

    result = coordinator.schedule(worker_fn)
    assert await result == 0.125
    assert await result.get() == 0.125
    for _ in range(10):
        result = coordinator.schedule(worker_fn)
    await coordinator.join()
    assert coordinator.done()
    assert await v1.numpy() == pytest.approx(1.1, rel=1e-5)
    assert await v2.numpy() == pytest.approx(-1.2, rel=1e-5)
    await coordinator.close()


async def test_results_keep_their_structure_and_none(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def nested(x):
        return (x + 1, (x + 2, x + 3), [x + 4], {"v": x, "a": np.arange(3) * x})

    def nothing():
        pass

    rv = coordinator.schedule(nested, args=(1,))
    out = await rv
    assert out[:3] == (2, (3, 4), [5]) and type(out) is tuple and type(out[2]) is list
    assert out[3]["v"] == 1 and isinstance(out[3]["a"], np.ndarray)
    np.testing.assert_array_equal(out[3]["a"], [0, 1, 2])
    fetched = await coordinator.fetch({"r": rv, "plain": 7, "t": (rv,)})
    assert fetched["plain"] == 7 and fetched["r"][:3] == (2, (3, 4), [5])
    assert fetched["t"][0][1] == (3, 4)
    assert await coordinator.schedule(nothing) is None
    await coordinator.close()


async def test_fetch_blocks_from_a_thread_and_refuses_on_the_loop(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def slow():
        time.sleep(0.3)
        return 42

    rv = coordinator.schedule(slow)
    with pytest.raises(RuntimeError, match="await"):
        rv.fetch()
    got = []
    thread = threading.Thread(target=lambda: got.append(rv.fetch()))
    thread.start()
    await coordinator.join()
    await asyncio.get_running_loop().run_in_executor(None, thread.join, 10)
    assert got == [42] and rv.done()
    with pytest.raises(RuntimeError, match="await"):
        rv.fetch()  # refused on the loop thread even when ready
    await coordinator.close()


async def test_assign_add_accumulates_across_joins(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        v = pstrain.Variable(0.0)
    for _ in range(5):
        coordinator.schedule(lambda: v.assign_add(2.0))  # a plain def returning a coroutine works
    await coordinator.join()
    assert await v.numpy() == 10.0
    for _ in range(5):
        coordinator.schedule(lambda: v.assign_add(2.0))
    await coordinator.join()
    assert await v.numpy() == 20.0
    assert coordinator.done()
    await coordinator.close()


async def test_first_error_cancels_the_rest_then_the_coordinator_keeps_working(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=1)
    with strategy.scope():
        started = pstrain.Variable(0, name="started")
        done = pstrain.Variable(0, name="done")

    async def long_running():
        await started.assign_add(1)
        await asyncio.sleep(60)

    async def fail():
        raise KeyError("boom in a closure")

    async def step():
        await done.assign_add(1)
        return 1

    long_rv = coordinator.schedule(long_running)
    await wait_for(lambda: started.numpy(), what="the long closure to start")
    fail_rv = coordinator.schedule(fail)
    queued = [coordinator.schedule(step) for _ in range(5)]
    t = time.monotonic()
    with pytest.raises(KeyError, match="boom in a closure") as info:
        await coordinator.join()
    assert time.monotonic() - t < 30  # the 60 s closure was cancelled, not waited for
    assert "task:" in "".join(getattr(info.value, "__notes__", []))
    with pytest.raises(KeyError):
        await fail_rv
    with pytest.raises(CancelledError, match="cancelled"):
        await long_rv
    for rv in queued:
        with pytest.raises(CancelledError):
            await rv
    assert coordinator.done()  # the error was cleared
    more = [coordinator.schedule(step) for _ in range(3)]
    await coordinator.join()
    assert [await rv for rv in more] == [1, 1, 1]
    assert await done.numpy() == 3
    await coordinator.close()


async def test_pending_error_is_raised_by_schedule_and_done(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def bad():
        raise ValueError("bad value")

    coordinator.schedule(bad)
    await wait_for(lambda: coordinator.queue.error is not None, what="the failure to arrive")
    with pytest.raises(ValueError, match="bad value"):
        coordinator.schedule(lambda: 1)
    assert coordinator.done()

    coordinator.schedule(bad)
    await wait_for(lambda: coordinator.queue.error is not None, what="the failure to arrive")
    with pytest.raises(ValueError):
        coordinator.done()
    assert await coordinator.schedule(lambda: 5) == 5
    await coordinator.close()


async def test_pstrain_errors_come_back_as_themselves(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        v = pstrain.Variable(np.zeros(3, np.float32))

    async def wrong_shape():
        await v.assign(np.zeros(4))

    with pytest.raises(InvalidArgumentError, match="shape"):
        await coordinator.schedule(wrong_shape)
    with pytest.raises(InvalidArgumentError):
        await coordinator.join()
    await coordinator.close()


async def test_placement_is_round_robin_and_colocation(tmp_path):
    async with InProcessCluster(num_ps=3, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            vs = [pstrain.Variable(float(i)) for i in range(4)]
            with strategy.extended.colocate_vars_with(vs[1]):
                c = pstrain.Variable(np.ones((10, 2)))
            after = pstrain.Variable(5.0)
        assert [v.device for v in vs] == [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1, 2, 0)]
        assert c.device == vs[1].device
        assert after.device == "/job:ps/replica:0/task:1/device:CPU:0"
        assert strategy.extended.parameter_devices == tuple(
            f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(3)
        )
        assert strategy.extended.worker_devices == ("/job:worker/replica:0/task:0/device:CPU:0",)
        assert [await v.numpy() for v in vs] == [0.0, 1.0, 2.0, 3.0]
        local = pstrain.Variable(3.0)  # outside any scope: local to this process
        assert "/job:ps" not in local.device
        await local.assign_add(1.0)
        assert await local.numpy() == 4.0
        await rpc.close_loop_channels()


async def test_run_reduce_and_replica_context_inside_a_closure(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        v = pstrain.Variable(1.0)

    async def step(x):
        async def replica_fn(x):
            ctx = pstrain.get_replica_context()
            value = await v.read_value()
            return (
                ctx.all_reduce("sum", x + value),
                x - value,
                ctx.replica_id_in_sync_group,
                ctx.num_replicas_in_sync,
            )

        a, b, rid, n = await strategy.run(replica_fn, args=(x,))
        return (
            strategy.reduce("SUM", a, axis=None),
            strategy.reduce(pstrain.ReduceOp.MEAN, b, axis=None),
            rid,
            n,
            len(strategy.experimental_local_results(a)),
        )

    assert await coordinator.schedule(step, args=(3.0,)) == (4.0, 2.0, 0, 1, 1)
    assert strategy.num_replicas_in_sync == 1
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync])
    )
    assert isinstance(values, pstrain.DistributedValues)
    np.testing.assert_array_equal(strategy.gather(values, axis=0), [0, 1])
    per = pstrain.PerReplica([np.array([1.0, 2.0]), np.array([3.0, 4.0])])
    assert strategy.reduce("sum", per, axis=0) == 10.0
    assert strategy.reduce("MEAN", per, axis=0) == 2.5
    np.testing.assert_array_equal(strategy.reduce("SUM", per, axis=None), [4.0, 6.0])
    with pytest.raises(InvalidArgumentError, match="reduce op"):
        strategy.reduce("max", per)
    await coordinator.close()


def _ranges():
    index = pstrain.get_current_worker_index()
    return iter(range(index * 1000, index * 1000 + 500))


async def test_per_worker_datasets_are_each_workers_own(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    dataset = coordinator.create_per_worker_dataset(_ranges)
    iterator = iter(dataset)
    with pytest.raises(NotImplementedError):
        next(iterator)

    def step(it):
        return pstrain.get_current_worker_index(), next(it)

    rvs = [coordinator.schedule(step, args=(iterator,)) for _ in range(60)]
    await coordinator.join()
    seen = {0: [], 1: []}
    for rv in rvs:
        worker, value = await rv
        seen[worker].append(value)
    assert sum(len(v) for v in seen.values()) == 60
    for worker, values in seen.items():
        assert sorted(values) == list(range(worker * 1000, worker * 1000 + len(values)))
    # A fresh iter() starts again from the beginning.
    again = iter(dataset)
    assert (await coordinator.schedule(step, args=(again,)))[1] % 1000 == 0
    await coordinator.close()


async def test_a_dataset_that_fails_to_build_fails_its_consumers(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def broken():
        raise OSError("no such data")

    it = iter(coordinator.create_per_worker_dataset(broken))
    with pytest.raises(ClosureInputError, match="no such data"):
        await coordinator.schedule(lambda it: next(it), args=(it,))
    with pytest.raises(ClosureInputError):
        await coordinator.join()
    assert await coordinator.schedule(lambda: "unaffected") == "unaffected"
    await coordinator.close()


async def test_remote_value_as_input(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def produce():
        time.sleep(0.2)
        return np.arange(4)

    def consume(x, scale):
        return x * scale

    produced = coordinator.schedule(produce)
    consumed = coordinator.schedule(consume, args=(produced,), kwargs={"scale": 3})
    np.testing.assert_array_equal(await consumed, [0, 3, 6, 9])

    def fail():
        raise RuntimeError("producer failed")

    bad = coordinator.schedule(fail)
    after = coordinator.schedule(consume, args=(bad, 1))
    with pytest.raises(RuntimeError, match="producer failed"):
        await coordinator.join()
    with pytest.raises(ClosureInputError, match="producer failed"):
        await after  # whether it was queued or waiting for its input when the producer failed
    bad2 = coordinator.schedule(fail)
    with pytest.raises(RuntimeError):
        await coordinator.join()
    with pytest.raises(ClosureInputError, match="producer failed"):
        await coordinator.schedule(consume, args=(bad2, 1))
    with pytest.raises(ClosureInputError):
        await coordinator.join()
    await coordinator.close()


async def test_schedule_rejects_non_callables_and_is_a_singleton(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    assert pstrain.ClusterCoordinator(strategy) is coordinator
    with pytest.raises(TypeError, match="callable"):
        coordinator.schedule(42)
    await coordinator.join()  # nothing scheduled: returns at once
    await coordinator.join()
    assert coordinator.done()
    await coordinator.close()


async def test_worker_stays_responsive_while_a_closure_burns_cpu(cluster):
    coordinator = pstrain.ClusterCoordinator(
        pstrain.ParameterServerStrategy(cluster.resolver), max_inflight_per_worker=1
    )

    def burn():
        end = time.time() + 3
        while time.time() < end:
            pass
        return "burnt"

    async def burn_async():
        return burn()

    rvs = [coordinator.schedule(burn), coordinator.schedule(burn_async)]
    peers = rpc.ChannelPool(cluster.cluster_spec, cluster.token)
    await wait_for(lambda: all(coordinator.queue.in_flight_on(i) for i in (0, 1)), what="both workers busy")
    for index in (0, 1):
        t = time.monotonic()
        health = await peers.channel("worker", index).health(timeout=1.0)
        assert time.monotonic() - t < 1.0 and health.status == "running"
    assert [await rv for rv in rvs] == ["burnt", "burnt"]
    await peers.close()
    await coordinator.close()


async def test_each_function_travels_once_per_worker(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    payload = np.zeros(50_000)  # captured: makes the pickled function ~400 KB

    def big_closure(i):
        return float(payload.sum()) + i

    for i in range(20):
        coordinator.schedule(big_closure, args=(i,))
    await coordinator.join()
    peers = rpc.ChannelPool(cluster.cluster_spec, cluster.token)
    received = 0
    for index in (0, 1):
        stats = await peers.channel("worker", index).statistics()
        received += stats["requests"].get("worker/run", {}).get("bytes_in", 0)
    assert received < 3 * 400_000  # at most once per worker (plus small per-closure entries)
    await peers.close()
    await coordinator.close()


def _functions_held(cluster, coordinator):
    """(the coordinator's pickled functions, digests it counts each worker as holding,
    each worker's functions), by count and by bytes."""
    sent = [d.sent for d in coordinator.workers.dispatchers]
    kept = [w.runner.fns.kept for w in cluster.workers]
    return coordinator._fns._fns, sent, kept


async def test_a_new_function_every_step_keeps_a_bounded_number_of_them(cluster):
    """A loop that makes a new function each step (a lambda capturing the step) holds the
    last FUNCTIONS_KEPT on the coordinator and twice as many on a worker, not all of them;
    the function scheduled every step meanwhile is sent again whenever it was dropped."""
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    n = 2 * FUNCTIONS_KEPT + 600

    def hot(i):
        return -i

    rvs, hot_rvs = [], []
    for i in range(n):
        rvs.append(coordinator.schedule(lambda i=i: 2 * i))
        if i % 7 == 0:
            hot_rvs.append((i, coordinator.schedule(hot, args=(i,))))
        if i % 300 == 299:
            await coordinator.join()
    await coordinator.join()
    assert [await rv for rv in rvs] == [2 * i for i in range(n)]
    assert [await rv for _, rv in hot_rvs] == [-i for i, _ in hot_rvs]
    fns, sent, kept = _functions_held(cluster, coordinator)
    assert len(fns) <= FUNCTIONS_KEPT
    assert all(len(s) <= FUNCTIONS_KEPT for s in sent)
    assert all(0 < len(k) <= 2 * FUNCTIONS_KEPT for k in kept)
    assert sum(w.runner.closures_run for w in cluster.workers) == n + len(hot_rvs)
    await coordinator.close()


async def test_functions_that_capture_arrays_are_kept_to_a_number_of_bytes(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    size = 512 << 10
    n = (2 * FUNCTION_BYTES_KEPT) // size + 40  # past what a worker keeps
    alive = []
    for i in range(n):
        a = np.full(size // 8, i, np.float64)
        alive.append(weakref.ref(a))
        coordinator.schedule(lambda a=a: float(a[0]))
        if i % 50 == 49:
            await coordinator.join()
    await coordinator.join()
    del a
    gc.collect()
    fns, sent, kept = _functions_held(cluster, coordinator)
    assert fns.bytes <= FUNCTION_BYTES_KEPT and all(s.bytes <= FUNCTION_BYTES_KEPT for s in sent)
    assert all(k.bytes <= 2 * FUNCTION_BYTES_KEPT for k in kept)
    # The coordinator no longer holds the arrays its dropped functions captured.
    assert sum(r() is not None for r in alive) <= FUNCTION_BYTES_KEPT // size
    await coordinator.close()


async def test_a_closure_whose_function_the_worker_dropped_runs_once_sent_again(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    with coordinator.strategy.scope():
        v = pstrain.Variable(0.0)

    async def add(x):
        await v.assign_add(x)
        return x

    assert await coordinator.schedule(add, args=(1.0,)) == 1.0
    for w in cluster.workers:  # as after another coordinator sent each worker newer ones
        w.runner.fns.kept.clear()
    rvs = [coordinator.schedule(add, args=(2.0,)) for _ in range(4)]
    assert [await rv for rv in rvs] == [2.0] * 4
    assert await v.numpy() == 9.0  # each ran once
    assert coordinator.queue.retried_count == 0
    await coordinator.close()


async def test_a_worker_that_never_holds_a_function_fails_its_closure(cluster, monkeypatch):
    """Sent again with its bytes, a closure a worker still says it has no function for
    fails (a fault of the worker's), rather than going back and forth for ever."""
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    for w in cluster.workers:
        monkeypatch.setattr(w.runner.fns, "get", lambda digest: None)
    rv = coordinator.schedule(lambda: 1)
    with pytest.raises(ProtocolError, match="did not hold closure"):
        await rv
    await coordinator.close()


async def test_strategy_validates_the_cluster():
    with pytest.raises(InvalidArgumentError, match="at least one worker"):
        pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver({"ps": ["h:1"]}))
    with pytest.raises(InvalidArgumentError, match="at least one ps"):
        pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver({"worker": ["h:1"]}))
    with pytest.raises(InvalidArgumentError, match="at most one 'chief'"):
        pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver({"chief": ["h:1", "h:2"], "ps": ["h:3"], "worker": ["h:4"]})
        )
    with pytest.raises(InvalidArgumentError, match="Disallowed task type"):
        pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver({"ps": ["h:3"], "worker": ["h:4"], "foo": ["h:5"]})
        )


def test_module_collects_variables():
    class Dense(pstrain.Module):
        def __init__(self):
            super().__init__()
            self.w = pstrain.Variable(np.ones((2, 2)), name="w")
            self.b = pstrain.Variable(np.zeros(2), name="b", trainable=False)

    class Model(pstrain.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Dense(), Dense()]
            self.scale = pstrain.Variable(1.0, name="scale")

    m = Model()
    assert len(m.variables) == 5 and len(m.trainable_variables) == 3
    assert len(m.submodules) == 2


async def test_a_wrong_token_fails_join_fast_without_a_retry_loop(cluster, caplog):
    spec = cluster.cluster_spec
    wrong = pstrain.SimpleClusterResolver(spec, task_type="chief", task_id=0, token="not-the-token")
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(wrong))
    rv = coordinator.schedule(lambda: 1)
    t = time.monotonic()
    with pytest.raises(pstrain.errors.AuthenticationError, match="cluster token"):
        await asyncio.wait_for(coordinator.join(), 10)
    assert time.monotonic() - t < 10
    with pytest.raises(CancelledError):
        await rv
    # Each worker refused once: no reconnect loop in the log. (The client proves first, so
    # a wrong token is the server's refusal, "rejected the cluster token".)
    refusals = [
        r
        for r in caplog.records
        if r.name == "pstrain._coordinator.dispatch" and "rejected the cluster token" in r.getMessage()
    ]
    assert 1 <= len(refusals) <= len(spec.job_tasks("worker"))
    with pytest.raises(pstrain.errors.AuthenticationError):  # from schedule or join: the ps
        coordinator.schedule(lambda: 2)  # refuse us too, and no worker can run it
        await asyncio.wait_for(coordinator.join(), 10)
    await coordinator.close()


def test_strategy_api_accepts_tfs_argument_names_and_refuses_what_tf_refuses():
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": ["127.0.0.1:9"], "worker": ["127.0.0.1:9"]})
    )
    assert strategy.run(lambda x: x + 1, args=(1,), options=None) == 2
    with pytest.raises(InvalidArgumentError, match="list or a tuple"):
        strategy.run(lambda x: x, args=np.ones(2))
    with pytest.raises(InvalidArgumentError, match="2 parts"):
        strategy.run(lambda x: x, args=(pstrain.PerReplica([1, 2]),))
    assert strategy.run(lambda x: x, args=(pstrain.PerReplica([5]),)) == 5
    # run enters the scope: a variable made inside lives on the ps
    made = strategy.run(lambda: pstrain.Variable(1.0, name="inside_run"))
    assert made.device.startswith("/job:ps/")
    with pytest.raises(InvalidArgumentError, match="inside strategy.scope"):
        with strategy.extended.colocate_vars_with(made):
            pass
    assert strategy.extended.experimental_require_static_shapes is False
    assert strategy.extended.batch_reduce_to(
        "SUM", [(pstrain.PerReplica([np.ones(2)]), None)], experimental_hints=None
    )[0].tolist() == [1, 1]
    with pytest.raises(InvalidArgumentError, match="rank"):
        strategy.gather(pstrain.PerReplica([np.float32(1)]), axis=0)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        strategy.gather(pstrain.PerReplica([np.ones((2, 3))]), axis=2)
    with pytest.raises(InvalidArgumentError, match="cross-replica"):
        strategy.run(lambda: strategy.gather(np.ones(2), axis=0))
    np.testing.assert_array_equal(
        strategy.gather(pstrain.PerReplica([np.ones((2, 3))]), axis=-1), np.ones((2, 3))
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_inflight_per_worker": 0}, "max_inflight_per_worker must be a whole number of 1 or more"),
        ({"max_batch": 0}, "max_batch must be a whole number of 1 or more, got 0"),
        ({"max_batch": 2.5}, "max_batch must be a whole number"),
        ({"worker_timeout_s": -1}, "worker_timeout_s must be a finite number of seconds above 0"),
        ({"ps_timeout_s": float("nan")}, "ps_timeout_s must be a finite number of seconds above 0"),
        ({"heartbeat_s": 0}, "heartbeat_s must be a finite number of seconds above 0, got 0"),
        ({"probe_initial_s": float("inf")}, "probe_initial_s must be a finite number of seconds"),
        ({"cancel_grace_s": -0.5}, "cancel_grace_s must be a finite number of seconds of 0 or more"),
        ({"no_worker_timeout_s": 0}, "no_worker_timeout_s must be a finite number of seconds above 0"),
    ],
)
def test_coordinator_options_out_of_range_are_refused_before_it_attaches(options, message):
    """max_batch=0 used to be taken: no closure was ever sent, and join() waited for good."""
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": ["127.0.0.1:9"], "worker": ["127.0.0.1:9"]})
    )
    with pytest.raises(InvalidArgumentError, match=re.escape(f"ClusterCoordinator: {message}")):
        pstrain.ClusterCoordinator(strategy, **options)
    assert strategy.coordinator is None  # nothing changed: a right one can still be made


async def test_what_schedule_or_a_ps_cannot_take_is_refused_at_the_call(cluster):
    """Each refused at the call that gave it, changing nothing; the same calls done right
    then work, under the names the refused ones would have taken."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        with pytest.raises(InvalidArgumentError, match="a variable's name must be a string, got 7"):
            pstrain.Variable(1.0, name=7)
        with pytest.raises(InvalidArgumentError, match="a ps holds numbers and bools, not <U3"):
            pstrain.Variable(np.array(["abc"]), name="words")
        with pytest.raises(InvalidArgumentError, match="a ps holds numbers and bools, not object"):
            pstrain.Variable(pstrain.initializers.Zeros(), name="words", shape=(2,), dtype=object)
        with pytest.raises(InvalidArgumentError, match="initial_value is not an array: .*inhomogeneous"):
            pstrain.Variable([[1.0, 2.0], [3.0]], name="words")
        with pytest.raises(InvalidArgumentError, match="dtype: 'flaot32' is not a dtype"):
            pstrain.Variable(1.0, name="words", dtype="flaot32")
        v = pstrain.Variable(np.zeros(2, np.float32), name="words")
    assert v.name == "words"  # the refused ones took no name
    local = pstrain.Variable(np.array(["kept"]))  # outside a scope: strings, as in TF
    assert (await local.numpy()).tolist() == ["kept"]
    coordinator = pstrain.ClusterCoordinator(strategy)

    async def add(x):
        await v.assign_add(x)

    with pytest.raises(TypeError, match="args must be a tuple or a list and kwargs a dict, got int"):
        coordinator.schedule(add, args=5)
    with pytest.raises(TypeError, match="kwargs a dict, got tuple and list"):
        coordinator.schedule(add, args=(), kwargs=[("x", 1)])
    with pytest.raises(TypeError, match="needs a function returning a dataset .* got int"):
        coordinator.create_per_worker_dataset(5)
    assert coordinator.queue.queued == 0 and coordinator.queue.in_flight == 0
    coordinator.schedule(add, args=[np.ones(2, np.float32)])
    await coordinator.join()
    assert (await v.numpy()).tolist() == [1.0, 1.0]
    await coordinator.close()


def test_a_strategy_or_local_cluster_given_the_wrong_thing_says_what_it_needs():
    with pytest.raises(InvalidArgumentError, match="needs a cluster resolver .* got None"):
        pstrain.ParameterServerStrategy(None)
    with pytest.raises(InvalidArgumentError, match="a LocalCluster's .resolver"):
        pstrain.ParameterServerStrategy(pstrain.LocalCluster(1, 1))  # the cluster, not its resolver
    resolver = pstrain.SimpleClusterResolver({"ps": ["127.0.0.1:9"], "worker": ["127.0.0.1:9"]})
    with pytest.raises(InvalidArgumentError, match="variable_partitioner must be a partitioner"):
        pstrain.ParameterServerStrategy(resolver, variable_partitioner=2)
    with pytest.raises(
        InvalidArgumentError, match="LocalCluster: num_ps must be a whole number of 1 or more, got '2'"
    ):
        pstrain.LocalCluster(num_ps="2")
    with pytest.raises(InvalidArgumentError, match="'LOUD' is not a log level"):
        pstrain.LocalCluster(log_level="LOUD")  # refused before any process starts
    with pytest.raises(InvalidArgumentError, match="startup_timeout_s must be a finite number"):
        pstrain.LocalCluster(startup_timeout_s=0)
    assert pstrain.LocalCluster(log_level="debug").log_level == "DEBUG"


async def test_local_variables_own_their_memory_and_metrics_reset_states():
    source = np.zeros(3, np.float32)
    v = pstrain.Variable(source)
    source[:] = 7  # the caller's array changes later
    assert (await v.numpy()).tolist() == [0, 0, 0]
    m = pstrain.metrics.Mean()
    await m.update_state([2.0, 4.0])
    await m.reset_states()
    assert await m.result() == 0.0


async def test_a_dropped_per_worker_iterator_is_released_on_the_workers(cluster):
    """Neither the dispatcher nor a worker thread keeps the last closure's arguments."""

    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    dataset = coordinator.create_per_worker_dataset(lambda: pstrain.data.Dataset.range(100))
    it = iter(dataset)

    def take(iterator):
        return int(next(iterator))

    for _ in range(8):
        coordinator.schedule(take, args=(it,))
    await coordinator.join()
    await wait_for(lambda: all(len(w.resources) == 2 for w in cluster.workers), what="built")
    del it
    gc.collect()
    await wait_for(
        lambda: all(len(w.resources) == 1 for w in cluster.workers),
        what="the iterators dropped on every worker (the dataset stays)",
    )
    assert dataset is not None
    await coordinator.close()


async def test_a_reply_larger_than_the_coordinator_takes_fails_its_calls_at_once(cluster):
    """A reply over the receiver's limit for one message is skipped as it arrives; its call
    used to wait for it until its deadline, and a closure's RemoteValue with none, forever.
    (The limit is made small here; it is 2 GiB by default.)"""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    strategy.channels.max_body = 200_000  # before any channel is made
    async with strategy.scope():
        v = pstrain.Variable(np.zeros(100_000, np.float32), name="v")  # 400 KB
    coordinator = pstrain.ClusterCoordinator(strategy)
    large = coordinator.schedule(lambda: np.zeros(100_000))
    with pytest.raises(pstrain.errors.ProtocolError, match="larger than this process's limit of 200000"):
        await asyncio.wait_for(large, 30)
    with pytest.raises(pstrain.errors.ProtocolError, match="larger than this process's limit"):
        await asyncio.wait_for(coordinator.join(), 30)
    with pytest.raises(pstrain.errors.ProtocolError, match="larger than this process's limit"):
        await asyncio.wait_for(v.read_value(), 30)
    assert await coordinator.schedule(lambda: 5) == 5  # the connections stay usable
    assert float((await v.sparse_read(np.arange(10))).sum()) == 0.0
    await coordinator.close()


def _explode():
    raise ValueError("boom at unpickle")


class _Unpicklable:
    """Pickles on the worker; unpickling it anywhere raises."""

    def __reduce__(self):
        return (_explode, ())


async def _only_the_third_failed(coordinator, rvs, reason: str, release=lambda i: None) -> None:
    """Of four closures in one batch (returning their index), the third failed for
    ``reason``; the others ended as closures beside a failed one do: each its value, or
    (TF's rule: the first error cancels what has not finished) CancelledError, never the
    third's error. join() raises it, the worker was not taken for lost, and the
    coordinator runs closures again. ``release(i)`` lets closure ``i`` end, in turn."""
    for i in range(4):
        release(i)
        if i == 2:
            with pytest.raises(InvalidArgumentError, match=reason):
                await asyncio.wait_for(rvs[i], 30)
            continue
        try:
            assert await asyncio.wait_for(rvs[i], 30) == i
        except CancelledError:
            pass
    with pytest.raises(InvalidArgumentError, match="could not be unpickled"):
        await asyncio.wait_for(coordinator.join(), 30)
    assert coordinator.membership()[0]["failures"] == 0
    assert await asyncio.wait_for(coordinator.schedule(lambda: 5), 30) == 5
    await coordinator.close()


#: Let closure ``i`` of ``_gated`` return: set by the test, waited on by the in-process
#: worker's threads (the events do not pickle: the closure finds them by importing this
#: module where it runs, in this process).
_GATES: list[threading.Event] = []


def _gated(i):
    from tests.cluster import test_coordinator as here

    if not here._GATES[i].wait(30):
        raise TimeoutError(f"closure {i} was never let through")
    return [i, {"x": _Unpicklable()}] if i == 2 else i


@pytest.mark.parametrize("when", ["together", "one at a time"])
async def test_a_result_the_coordinator_cannot_unpickle_fails_its_closure_alone(when):
    """Its RemoteValue raises the reason; the closures beside it end as closures beside a
    failed one do (their values, or cancelled), and the worker is not taken for lost. (A
    result in a partial reply used to close the connection: the worker was lost, its
    closures ran again, and again, for ever.) One at a time: each closure returns only once
    the one before reached the coordinator, so each result comes in a reply of its own."""
    _GATES[:] = [threading.Event() for _ in range(4)]
    if when == "together":
        for gate in _GATES:
            gate.set()
    async with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        coordinator = pstrain.ClusterCoordinator(
            pstrain.ParameterServerStrategy(cluster.resolver), max_inflight_per_worker=8
        )
        rvs = [coordinator.schedule(_gated, args=(i,)) for i in range(4)]  # one batch: in flight
        await _only_the_third_failed(
            coordinator,
            rvs,
            "result could not be unpickled on the coordinator: ValueError: boom",
            release=lambda i: _GATES[i].set(),
        )


async def test_an_argument_a_worker_cannot_unpickle_fails_its_closure_alone():
    """It failed every closure of its batch, as a "malformed message"; now it fails alone,
    and the others end as closures beside a failed one do (their values, or cancelled)."""
    async with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        coordinator = pstrain.ClusterCoordinator(
            pstrain.ParameterServerStrategy(cluster.resolver), max_inflight_per_worker=8
        )
        rvs = [
            coordinator.schedule(
                lambda x, y=None: x, args=(i,), kwargs={"y": _Unpicklable()} if i == 2 else {}
            )
            for i in range(4)
        ]
        await _only_the_third_failed(
            coordinator, rvs, "arguments could not be unpickled on this worker: ValueError: boom"
        )
