"""The strategy API of TF's pages, adapted to ``await`` and one replica per worker: context
functions, merge_call, dataset distribution (as TF's tutorial uses it), the seed pages'
examples with their documented numbers, and the refusals TF makes."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import pstrain
from pstrain.data import Dataset, TensorSpec
from pstrain.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(60)


def test_context_functions_outside_inside_scope_and_in_run(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    default = pstrain.get_strategy()
    assert default is not strategy and default.num_replicas_in_sync == 1
    assert not pstrain.has_strategy() and not pstrain.in_cross_replica_context()
    assert pstrain.get_replica_context() is not None  # the default replica context
    assert default.run(lambda x: x + 1, args=(1,)) == 2
    with strategy.scope():
        assert pstrain.get_strategy() is strategy and pstrain.has_strategy()
        assert pstrain.in_cross_replica_context() and pstrain.get_replica_context() is None

        def replica_fn():
            ctx = pstrain.get_replica_context()
            assert not pstrain.in_cross_replica_context() and pstrain.get_strategy() is strategy

            def merge_fn(s, value):
                assert s is strategy and pstrain.in_cross_replica_context()
                return s.reduce("SUM", value, axis=None) * 10

            return ctx.merge_call(merge_fn, args=(3.0,)), ctx.replica_id_in_sync_group

        assert strategy.run(replica_fn) == (30.0, 0)
        assert strategy.extended.call_for_each_replica(lambda a, b: a * b, args=(6, 7)) == 42
        other = pstrain.ParameterServerStrategy(cluster.resolver)
        with pytest.raises(InvalidArgumentError, match="Mixing different strategies"):
            with other.scope():
                pass
    assert not pstrain.has_strategy()


def test_the_seed_pages_value_examples(cluster):
    """experimental_distribute_values_from_function, gather and reduce from TF's page, with one
    replica: each documented tuple has one element, and gather concatenates one component."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    assert strategy.experimental_local_results(values) == (1.0,)
    array_value = np.array([3.0, 2.0, 1.0])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group]
    )
    assert strategy.experimental_local_results(values) == (3.0,)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert strategy.experimental_local_results(values) == (1,)
    values = strategy.experimental_distribute_values_from_function(lambda _: np.array([[1], [2]], np.int32))
    assert strategy.gather(values, axis=0).tolist() == [[1], [2]]
    single = np.arange(6).reshape(1, 2, 3)
    values = strategy.experimental_distribute_values_from_function(lambda _: single)
    for axis in (0, 1, 2):
        assert strategy.gather(values, axis=axis).shape == (1, 2, 3)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        strategy.gather(values, axis=3)
    per_replica = strategy.run(lambda: np.array([1.0, 2.0]))
    assert strategy.reduce("sum", per_replica, axis=None).tolist() == [1.0, 2.0]
    assert strategy.reduce("sum", per_replica, axis=0) == 3.0


def test_experimental_distribute_dataset_as_on_the_page(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    global_batch_size = 2
    dataset = Dataset.range(4).batch(global_batch_size)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    result = [strategy.run(lambda x: x * 2, args=(x,)) for x in dist_dataset]
    # TF's two GPUs show [0] [2] and [4] [6]; one replica holds the whole batch.
    assert [r.tolist() for r in result] == [[0, 2], [4, 6]]
    assert dist_dataset.element_spec == TensorSpec((None,), np.int64)
    assert strategy.experimental_distribute_dataset(
        Dataset.range(4).batch(2, drop_remainder=True)
    ).element_spec == TensorSpec((2,), np.int64)
    with pytest.raises(InvalidArgumentError, match="PER_REPLICA"):
        pstrain.InputOptions(experimental_replication_mode=pstrain.InputReplicationMode.PER_REPLICA)
    with pytest.raises(InvalidArgumentError, match="options must be an InputOptions"):
        strategy.experimental_distribute_dataset(dataset, options={"prefetch": 1})
    options = pstrain.InputOptions(experimental_fetch_to_device=False)
    assert strategy.experimental_distribute_dataset(dataset, options).options is options
    with pytest.raises(InvalidArgumentError, match="not divisible"):
        pstrain.InputContext(num_replicas_in_sync=3).get_per_replica_batch_size(64)


async def test_tutorial_input_pipeline_on_every_worker(cluster):
    """TF's tutorial: create_per_worker_dataset(fn that calls distribute_datasets_from_function)."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    features = np.arange(64, dtype=np.float32).reshape(32, 2)

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(8)
        info = (
            input_context.num_input_pipelines,
            input_context.input_pipeline_id,
            input_context.num_replicas_in_sync,
            pstrain.get_current_worker_index(),
        )
        return Dataset.from_tensor_slices(features).shuffle(32).batch(batch).repeat().map(lambda b: (b, info))

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    def step(iterator):
        batch, info = next(iterator)
        return batch.shape, info

    results = [coordinator.schedule(step, args=(per_worker_iterator,)) for _ in range(6)]
    await coordinator.join()
    outcomes = [await r for r in results]
    assert all(shape == (8, 2) for shape, _ in outcomes)
    assert {info[:3] for _, info in outcomes} == {(1, 0, 1)}  # TF's values for this strategy
    assert {info[3] for _, info in outcomes} <= {0, 1}  # built on the workers
    # a DistributedDataset made on the coordinator works too
    distributed = strategy.experimental_distribute_dataset(Dataset.range(10).batch(5))
    it = iter(coordinator.create_per_worker_dataset(distributed))
    assert (await coordinator.schedule(lambda i: next(i).tolist(), args=(it,))) == [0, 1, 2, 3, 4]
    await coordinator.close()


async def test_a_dataset_fn_that_creates_variables_is_refused(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)

    def dataset_fn():
        pstrain.Variable(1.0)
        return Dataset.range(3)

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    rv = coordinator.schedule(lambda i: next(i), args=(it,))
    with pytest.raises(Exception, match="Creating variables in `dataset_fn` is not allowed"):
        await coordinator.join()
    with pytest.raises(Exception, match="Creating variables in `dataset_fn` is not allowed"):
        await rv
    await coordinator.close()


async def test_run_and_reduce_on_the_coordinator_warn_once(cluster, caplog):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with caplog.at_level(logging.WARNING, logger="pstrain._distribute.strategy"):
        assert (
            await coordinator.schedule(lambda: strategy.reduce("SUM", strategy.run(lambda: 2.0), axis=None))
            == 2.0
        )
        assert "without using `ClusterCoordinator.schedule`" not in caplog.text
        strategy.run(lambda: 1.0)
        strategy.reduce("SUM", 1.0, axis=None)
    assert caplog.text.count("without using `ClusterCoordinator.schedule`") == 1
    await coordinator.close()


async def test_reduce_and_gather_take_a_nested_structure_leaf_by_leaf(cluster):
    """TF reduces a nested structure (what ``strategy.run`` returns: a loss and metrics)
    leaf by leaf; pstrain did ``np.asarray`` of it, and with ``axis`` summed the leaves
    together. Both the strategy and the default one, inside a closure and outside."""
    import collections

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    Out = collections.namedtuple("Out", "loss, per_class")
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])

    def step():
        out = strategy.run(lambda: Out(np.float32(2.0), {"a": x, "b": [np.array([1.0, 3.0])]}))
        return strategy.reduce("MEAN", out, axis=None), strategy.reduce("SUM", (x, [x[0]]), axis=0)

    reduced, summed = await coordinator.schedule(step)
    assert isinstance(reduced, Out) and reduced.loss == 2.0
    np.testing.assert_array_equal(reduced.per_class["a"], x)
    assert summed[0].tolist() == [9.0, 12.0] and summed[1][0] == 3.0
    default = pstrain.get_strategy()
    assert default.reduce("SUM", {"a": (x, x[:, 0])}, axis=0)["a"][1] == 9.0
    replicas = pstrain.PerReplica([(np.array([1.0, 2.0]), np.array([3.0]))])
    assert [float(v) for v in default.reduce("SUM", replicas, axis=0)] == [3.0, 3.0]
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match="axis 2 is out of range for a value of rank 2"
    ):
        strategy.reduce("SUM", x, axis=2)
    await coordinator.close()


async def test_the_seed_pages_run_reduce_scope_and_distributed_values_examples(cluster):
    """The remaining examples of TF's pages, with one replica: where TF's two GPUs show two
    components (or their sum), one replica shows one."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    # reduce: the replica id summed over replicas (TF's 1 GPU: 0; its 2 GPUs: 1)
    per_replica_result = strategy.run(lambda: pstrain.get_replica_context().replica_id_in_sync_group)
    assert strategy.reduce("SUM", per_replica_result, axis=None) == 0
    # run 1: a constant input
    assert strategy.run(lambda x: x * 2.0, args=(np.float32(3.0),)) == 6.0
    # run 2: DistributedValues input (TF's 2 replicas give 4; one gives 2)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    assert strategy.run(lambda x: x * 2, args=(values,)) == 2
    # run 3: all_reduce of the replica id (TF's 2 replicas: 1 each; one replica: 0)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)
    assert strategy.run(lambda x: pstrain.get_replica_context().all_reduce("sum", x), args=(values,)) == 0
    # scope: a variable inside lives on a ps; outside it is a regular (local) variable
    with strategy.scope():
        placed = pstrain.Variable(1.0)
    regular = pstrain.Variable(1.0)
    assert placed.name == regular.name == "Variable"
    assert placed.device.startswith("/job:ps/") and regular.device.startswith("/job:chief/")
    assert await placed.numpy() == await regular.numpy() == 1.0
    # DistributedValues page: iterate a distributed dataset, run, reduce, local results
    dataset = Dataset.from_tensor_slices(np.array([5.0, 6.0, 7.0, 8.0], np.float32)).batch(2)
    distributed_values = next(iter(strategy.experimental_distribute_dataset(dataset)))
    assert strategy.run(lambda x: x + 1.0, args=(distributed_values,)).tolist() == [6.0, 7.0]
    assert strategy.reduce(pstrain.ReduceOp.SUM, distributed_values, axis=0) == 11.0
    assert [v.tolist() for v in strategy.experimental_local_results(distributed_values)] == [[5.0, 6.0]]
