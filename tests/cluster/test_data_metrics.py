"""Dataset pipelines, per-worker shuffling, metrics on the ps, and extended.update."""

from __future__ import annotations

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain.data import Dataset
from pstrain.errors import InvalidArgumentError
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(60)


def test_from_tensor_slices_batches_component_wise():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5)
    batches = list(Dataset.from_tensor_slices({"x": x, "y": y}).batch(2))
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[0]["x"], x[:2])
    np.testing.assert_array_equal(batches[2]["y"], [4])
    assert len(list(Dataset.from_tensor_slices((x, y)).batch(2, drop_remainder=True))) == 2
    elems = list(Dataset.from_tensor_slices((x, y)))
    assert type(elems[0]) is tuple and elems[0][1] == 0


def test_range_map_take_shard_repeat_prefetch():
    assert [int(v) for v in Dataset.range(3).repeat(2)] == [0, 1, 2, 0, 1, 2]
    assert [int(v) for v in Dataset.range(10).shard(3, 2)] == [2, 5, 8]
    assert [int(v) for v in Dataset.range(100).map(lambda v: v * 2).take(3)] == [0, 2, 4]
    assert [int(v) for v in Dataset.range(5).prefetch(2)] == [0, 1, 2, 3, 4]
    gen = Dataset.from_generator(lambda: ((i, i * i) for i in range(4)))
    assert [tuple(b) for b in gen.batch(2)][1][1].tolist() == [4, 9]
    ds = Dataset.range(3)
    assert list(ds) == list(ds)  # every iteration starts again
    assert [int(v) for v in Dataset.range(4).repeat().take(6)] == [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d.take("a"), "take count must be a whole number, got 'a'"),
        (lambda d: d.batch(True), "batch_size must be a whole number of 1 or more, got True"),
        (lambda d: d.batch(2.0), "batch_size must be a whole number of 1 or more, got 2.0"),
        (lambda d: d.repeat(1.5), "repeat count must be a whole number"),
        (lambda d: d.shard(2.0, 0), "num_shards must be a whole number"),
        (
            lambda d: d.prefetch(-5),
            r"prefetch buffer_size \(AUTOTUNE is -1: here 1\) must be a whole "
            r"number of -1 or more, got -5",
        ),
    ],
)
def test_a_pipeline_step_given_a_count_that_is_no_count_is_refused_when_built(make, message):
    """Refused when the pipeline is built, not on each worker when it is first iterated."""
    with pytest.raises(InvalidArgumentError, match=message):
        make(Dataset.range(5))
    assert list(Dataset.range(5).prefetch(pstrain.data.AUTOTUNE).take(np.int64(2))) == [0, 1]


def test_prefetch_propagates_errors():
    def broken():
        yield 1
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        list(Dataset.from_generator(broken).prefetch(2))


def test_shuffle_is_a_permutation_seeded_or_not():
    def order(seed, buffer=10):
        return [int(v) for v in Dataset.from_tensor_slices(np.arange(100)).shuffle(buffer, seed=seed)]

    a = order(1)
    assert sorted(a) == list(range(100)) and a != list(range(100))
    assert order(1) == a  # same seed, same order
    assert order(2) != a  # another seed, another order
    assert order(None) != order(None)  # unseeded: fresh randomness each time
    epochs = [int(v) for v in Dataset.from_tensor_slices(np.arange(50)).shuffle(50, seed=3).repeat(2)]
    assert sorted(epochs[:50]) == sorted(epochs[50:]) and epochs[:50] != epochs[50:]


async def test_shuffle_differs_between_workers_unless_seeded(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))

    def maker(seed):
        def make():
            return Dataset.from_tensor_slices(np.arange(1000)).shuffle(1000, seed=seed).batch(1000).repeat()

        return make

    def first_batch(it):
        return pstrain.get_current_worker_index(), next(it).tolist()

    for seed, same in ((None, False), (42, True)):
        it = iter(coordinator.create_per_worker_dataset(maker(seed)))
        rvs = [coordinator.schedule(first_batch, args=(it,)) for _ in range(20)]
        await coordinator.join()
        first = {}
        for rv in rvs:  # one closure at a time per worker: its earliest is its first batch
            worker, values = await rv
            first.setdefault(worker, values)
        assert len(first) == 2
        assert sorted(first[0]) == sorted(first[1]) == list(range(1000))
        assert (first[0] == first[1]) is same
    await coordinator.close()


async def test_metrics_add_up_across_workers(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        mean = pstrain.metrics.Mean()
        total = pstrain.metrics.Sum()
        acc = pstrain.metrics.SparseCategoricalAccuracy()
        exact = pstrain.metrics.Accuracy()
        auc = pstrain.metrics.AUC()
    assert len({v.device for v in acc.variables}) == 1  # one ps, one request per update

    async def step(i):
        await mean.update_state([i, i + 1.0])
        await total.update_state(i)
        await acc.update_state([0, 1], [[0.9, 0.1], [0.8, 0.2]])
        await exact.update_state([1, 2, 3], [1, 2, 0])

    for i in range(20):
        coordinator.schedule(step, args=(float(i),))
    await coordinator.join()
    assert await mean.result() == pytest.approx(np.mean([x for i in range(20) for x in (i, i + 1)]))
    assert await total.result() == sum(range(20))
    assert await acc.result() == 0.5
    assert await exact.result() == pytest.approx(2 / 3)
    await auc.update_state([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    assert await auc.result() == pytest.approx(0.75, abs=0.01)
    await auc.reset_state()
    await auc.update_state([0, 1], [0.2, 0.9])
    assert await auc.result() == pytest.approx(1.0, abs=0.01)
    await mean.reset_state()
    assert await mean.result() == 0.0
    await coordinator.close()


async def test_the_keras_metrics_of_ranking_models_add_up_on_the_ps(cluster):
    """Log loss, precision and recall, binary accuracy and RMSE from closures on both
    workers: the ps's totals give what one process computing every batch gives."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    kinds = [
        lambda m: m.BinaryCrossentropy(),
        lambda m: m.Precision(thresholds=[0.3, 0.5]),
        lambda m: m.Recall(),
        lambda m: m.BinaryAccuracy(),
        lambda m: m.RootMeanSquaredError(),
    ]
    with strategy.scope():
        remote = [make(pstrain.metrics) for make in kinds]
    local = [make(pstrain.metrics) for make in kinds]  # outside a scope: in this process
    rng = np.random.default_rng(3)
    batches = [
        (rng.integers(0, 2, (16, 1)), rng.uniform(0, 1, (16, 1)), rng.uniform(0, 1, 16)) for _ in range(12)
    ]

    async def step(labels, preds, weights):
        for m in remote:
            await m.update_state(labels, preds, sample_weight=weights)

    for batch in batches:
        coordinator.schedule(step, args=batch)
        for m in local:
            await m.update_state(*batch)
    await coordinator.join()
    for r, m in zip(remote, local):
        np.testing.assert_allclose(await r.result(), await m.result(), rtol=1e-12)
    assert len(remote[1].variables) == 2 and remote[1].variables[0].shape == (2,)  # a count per threshold
    await coordinator.close()


async def test_metrics_refuse_what_tf_refuses_and_change_nothing(ps_server):
    """AUC's predictions outside [0, 1] (NaN too: TF asserts the range), values that are
    not numbers, weights that fit no axis of the values: an error naming it, the state as it was."""
    with strategy_for(ps_server).scope():
        auc, mean, total = pstrain.metrics.AUC(), pstrain.metrics.Mean(), pstrain.metrics.Sum()
    await auc.update_state([0, 1], [0.2, 0.9])
    await mean.update_state([1.0, 3.0])
    await total.update_state([5.0])
    bad = [
        (auc.update_state([0, 1], [0.2, 1.5]), "AUC: predictions must be in \\[0, 1\\], got 1.5"),
        (auc.update_state([0, 1], [np.nan, 0.5]), "AUC: predictions must be in \\[0, 1\\], got nan"),
        (auc.update_state([0, 1, 1], [0.2, 0.5]), "AUC: 3 labels for 2 predictions"),
        (mean.update_state(["a"]), "Mean: the values must be numbers"),
        (mean.update_state([1.0, 2.0, 3.0], sample_weight=[1.0, 2.0]), "does not match the values"),
        (total.update_state({"x": 1}), "Sum: the values must be numbers"),
    ]
    for call, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            await call
    assert await auc.result() == pytest.approx(1.0, abs=0.01)
    assert await mean.result() == 2.0 and await total.result() == 5.0
    await mean.update_state([1.0, 4.0], sample_weight=[2.0])  # (a weight that broadcasts)
    assert await mean.result() == pytest.approx((1 + 3 + 2 * 1 + 2 * 4) / (2 + 2 * 2))


async def test_extended_update_runs_on_the_ps_and_moves_no_table_bytes(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        table = pstrain.Variable(
            pstrain.initializers.RandomNormal(stddev=1.0, seed=0), shape=(1_000_000, 4), name="table"
        )
        scale = pstrain.Variable(np.float32(0.5), name="scale")
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    before = (await ch.statistics())["requests"]

    def clip(t, s, limit):
        np.clip(t, -limit * s * 2, limit * s * 2, out=t)
        return float(np.abs(t).max())

    result = await strategy.extended.update(table, clip, args=(scale, 1.0))
    assert result == pytest.approx(1.0)
    after = (await ch.statistics())["requests"]
    moved = sum(after[k]["bytes_in"] + after[k]["bytes_out"] for k in after) - sum(
        before[k]["bytes_in"] + before[k]["bytes_out"] for k in before
    )
    assert moved < 10_000  # the 16 MB table stayed where it is
    rows = await table.sparse_read([0, 1, 2])
    assert np.abs(rows).max() <= 1.0
    assert strategy.extended.reduce_to("SUM", pstrain.PerReplica([1.0, 2.0])) == 3.0
    assert strategy.extended.batch_reduce_to("MEAN", [(pstrain.PerReplica([2.0, 4.0]), None)]) == [3.0]
    await ch.close()


async def test_exhausted_iterator_is_out_of_range(cluster):
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    it = iter(coordinator.create_per_worker_dataset(lambda: Dataset.range(0)))
    with pytest.raises(pstrain.errors.OutOfRangeError, match="End of sequence"):
        await coordinator.schedule(lambda it: next(it), args=(it,))
    with pytest.raises(pstrain.errors.OutOfRangeError):
        await coordinator.join()
    await coordinator.close()


def test_variable_aggregation_and_synchronization_are_accepted():
    v = pstrain.Variable(1.0, aggregation="sum", synchronization=pstrain.VariableSynchronization.ON_READ)
    assert v.aggregation is pstrain.VariableAggregation.SUM
    assert v.synchronization is pstrain.VariableSynchronization.ON_READ
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="aggregation"):
        pstrain.Variable(1.0, aggregation="median")
