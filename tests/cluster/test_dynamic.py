"""Dynamic embedding tables on real ps: admission, eviction, slots that follow their rows,
deterministic rows, optimizers, closures, /metrics, and checkpoints into 1, 2 and 3 ps."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pstrain
import pstrain.jax as pjax
import pstrain.torch as ptorch
from pstrain._formats.messages.operations import ApplyGradients, LookupTable, OptimizerRule
from pstrain._formats.numerics.idhash import initial_rows, shard_of
from pstrain._formats.numerics.optimizer_rules import RULES
from pstrain._kernels.id_index import IdIndex
from pstrain.errors import InvalidArgumentError
from pstrain.server.ps.checkpoints import snapshots
from pstrain.server.ps.tables.dynamic_table import DynamicTable
from pstrain.server.ps.tables.table_config import TableConfig
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(60)

BIG = np.array([2**63 - 1, -(2**63), 12345678901234567, -7, 0], np.int64)


def _init(ids, dim=4, seed=0):
    return initial_rows(np.asarray(ids, np.int64), dim, np.dtype("float32"), seed, -0.05, 0.05)


async def test_rows_are_created_at_first_lookup_with_deterministic_values_over_the_64_bit_space():
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="t")
        rows = await pstrain.embedding_lookup(table, BIG.reshape(1, 5))
        assert rows.shape == (1, 5, 4) and rows.dtype == np.float32
        np.testing.assert_array_equal(rows[0], _init(BIG))  # a function of id and seed alone
        again = await table.lookup(BIG[::-1])
        np.testing.assert_array_equal(again, _init(BIG[::-1]))
        assert await table.size() == 5
        # Each ps holds the ids that hash to it.
        held = [len(ps.tables["t"]) for ps in cluster.ps]
        assert held == [int(np.sum(shard_of(BIG, 2) == k)) for k in range(2)]
        ids, values = await table.export()
        np.testing.assert_array_equal(ids, np.sort(BIG))
        np.testing.assert_array_equal(values, _init(np.sort(BIG)))
        # Evaluation lookups change nothing, and unseen ids give the default row.
        unseen = await table.lookup([99, 100], training=False)
        assert not unseen.any() and await table.size() == 5


async def test_two_tables_given_one_name_are_two_tables_named_as_variables_are():
    """A name given twice in one strategy is made unique (``t``, ``t_1``), as a variable's is:
    two collections of the default name each keep their own dynamic table, where the second
    was the first's rows on the ps, silently (or refused at its first lookup if its width
    differed)."""
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            first = pstrain.DynamicEmbedding(4, name="t")
            second = pstrain.DynamicEmbedding(8, name="t")
            towers = [
                pstrain.EmbeddingCollection([pstrain.TableConfig("ids", None, 4, ["f"])]) for _ in range(2)
            ]
            opt = pstrain.optimizers.SGD(1.0)
            with pytest.raises(InvalidArgumentError, match="name must be a non-empty string"):
                pstrain.DynamicEmbedding(4, name="")
        assert (first.name, second.name) == ("t", "t_1")
        assert [c.tables["ids"].name for c in towers] == ["embeddings/ids", "embeddings/ids_1"]
        await first.lookup(np.arange(3))
        assert (await second.lookup(np.arange(5))).shape == (5, 8)
        ids = pstrain.KeyedJaggedTensor(["f"], np.array([7, 9]), np.array([1, 1]))
        pooled = await towers[0].lookup(ids)
        await towers[0].apply_gradients(pooled.gradients(np.ones((2, 4), np.float32)), opt)
        assert [await t.size() for t in (first, second)] == [3, 5]
        assert [await c.tables["ids"].size() for c in towers] == [2, 0]
        moved = (await towers[0].tables["ids"].lookup([7], training=False)) - _init(np.array([7]))
        np.testing.assert_allclose(moved, -np.ones((1, 4)), rtol=1e-6)
        assert not (await towers[1].tables["ids"].lookup([7], training=False)).any()
        assert sorted(cluster.ps[0].tables) == ["embeddings/ids", "embeddings/ids_1", "t", "t_1"]


async def test_admission_after_n_sightings_and_with_probability():
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            after3 = pstrain.DynamicEmbedding(4, name="after3", admit_after=3, default_value=-1.0)
            half = pstrain.DynamicEmbedding(4, name="half", admit_probability=0.5)
        ids = np.arange(1000, 1010)
        for sighting in (1, 2):
            rows = await after3.lookup(ids)
            assert (rows == -1.0).all(), f"admitted after {sighting} sightings"
            assert await after3.size() == 0
        np.testing.assert_array_equal(await after3.lookup(ids), _init(ids))
        assert await after3.size() == 10
        # A gradient for an id not yet admitted is dropped, not an error.
        with strategy.scope():
            opt = pstrain.optimizers.SGD(1.0)
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((1, 4)), [5]), after3)])
        assert await after3.size() == 10
        many = np.arange(4000, dtype=np.int64)
        await half.lookup(many)
        admitted = await half.size()
        assert 1700 < admitted < 2300  # about half at the first sighting
        await half.lookup(many)
        assert 2700 < await half.size() < 3300  # about half of the rest at the second


async def test_capacity_is_never_exceeded_lru_evicts_and_evicted_rows_restart_from_their_initial_value():
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="lru", capacity=100)
            opt = pstrain.optimizers.Adagrad(0.5)
        hot = np.arange(10, dtype=np.int64)
        for step in range(30):
            batch = np.concatenate([hot, 1000 + step * 20 + np.arange(20)])
            await table.lookup(batch)
            await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((batch.size, 4)), batch), table)])
            for ps in cluster.ps:
                assert len(ps.tables["lru"]) <= 50  # each of 2 ps holds at most 100 / 2
        stats = await table.statistics()
        assert stats["rows"] <= 100 and stats["evicted"] > 0
        assert stats["admitted"] - stats["evicted"] == stats["rows"]
        ids, rows = await table.export()
        assert set(hot.tolist()) <= set(ids.tolist())  # used every step: never the least recent
        assert 1000 not in set(ids.tolist())  # the first cold batch went long ago
        # The evicted id comes back at its initial value, and its Adagrad slot is fresh.
        np.testing.assert_array_equal(await table.lookup([1000]), _init([1000]))
        before = await table.lookup([1000])
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((1, 4)), [1000]), table)])
        after = await table.lookup([1000])
        expected = before - 0.5 * 1.0 / np.sqrt(0.1 + 1.0 + 1e-7)  # accumulator 0.1 + g*g
        np.testing.assert_allclose(after, expected, rtol=1e-5)
        assert cluster.ps[0].statistics(None)["tables"]["lru"]["rows"] <= 50


async def test_lfu_and_age_eviction():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            lfu = pstrain.DynamicEmbedding(2, name="lfu", capacity=3, eviction="lfu")
            aged = pstrain.DynamicEmbedding(2, name="aged", max_age=8)
        for _ in range(5):
            await lfu.lookup([1, 2])  # frequent
        await lfu.lookup([3])
        await lfu.lookup([4])  # full: the least frequently used (3) goes
        ids, _ = await lfu.export()
        assert ids.tolist() == [1, 2, 4]
        await aged.lookup([7, 8])
        for _ in range(20):
            await aged.lookup([8])
        ids, _ = await aged.export()
        assert ids.tolist() == [8]  # 7 was not seen for more than 8 lookups


async def test_lfu_evicts_the_least_recent_rows_of_a_count_not_the_rows_a_step_in_flight_made():
    # A full LFU table whose rows were each looked up once: every row ties. Two steps in
    # flight (as two workers run them) each admit new ids before either updates. The
    # second's lookup evicts the rows of that count looked up least recently, not the
    # rows the first just made: the first step's update lands on them. (The ties went to
    # the lowest rows, which the rows made last take: its update was dropped.)
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="lfu", capacity=100, eviction="lfu")
            opt = pstrain.optimizers.SGD(0.5)
        for k in range(5):
            await table.lookup(np.arange(20 * k, 20 * k + 20))
        first, second = np.arange(1000, 1020), np.arange(2000, 2020)
        await table.lookup(first)
        await table.lookup(second)
        for ids in (first, second):
            await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((20, 4)), ids), table)])
        ids, rows = await table.export()
        assert set(first.tolist()) | set(second.tolist()) <= set(ids.tolist())
        assert not set(range(40)) & set(ids.tolist())  # the rows of that count seen first went
        by_id = dict(zip(ids.tolist(), rows))
        for i in (*first, *second):
            np.testing.assert_allclose(by_id[int(i)], _init([i])[0] - 0.5, rtol=1e-6)


def test_an_id_is_not_aged_out_by_its_own_lookup_nor_its_row_given_to_another_id_of_it():
    # Id 1 turns stale exactly at the lookup that asks for it again, with a new id beside
    # it: it keeps its row and values, and the new id gets a row of its own.

    t = DynamicTable("t", TableConfig(dim=2, max_age=8))
    first = t.lookup(np.array([1]), train=True).copy()
    for k in range(8):
        t.lookup(np.array([100 + k]), train=True)
    ids = np.array([1, 999])
    out = t.lookup(ids, train=True, pos=t.locate(ids))
    np.testing.assert_array_equal(out[0], first[0])
    np.testing.assert_array_equal(out[1], _init([999], dim=2)[0])
    rows = t.positions(ids)
    assert rows.min() >= 0 and rows[0] != rows[1]


async def test_slots_follow_rows_under_every_sparse_optimizer_and_match_a_fixed_table():
    ids = np.array([3, 2**40, -5, 17], np.int64)
    grad = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    for make in (
        lambda: pstrain.optimizers.SGD(0.1, momentum=0.9),
        lambda: pstrain.optimizers.Adagrad(0.1),
        lambda: pstrain.optimizers.Adam(0.01),
        lambda: pstrain.optimizers.Ftrl(0.1),
    ):
        async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            with strategy.scope():
                table = pstrain.DynamicEmbedding(4, name="d")
                fixed = pstrain.Variable(_init(ids), name="fixed")
                opt_d, opt_f = make(), make()
            await table.lookup(ids)
            for _ in range(3):
                await opt_d.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
                await opt_f.apply_gradients([(pstrain.IndexedSlices(grad, np.arange(4)), fixed)])
            np.testing.assert_allclose(
                await table.lookup(ids), await fixed.numpy(), rtol=1e-6, err_msg=type(opt_d).__name__
            )


async def test_a_closure_retried_sees_the_same_rows_and_tables_reach_workers(tmp_path):
    async with InProcessCluster(num_ps=2, num_workers=2, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(8, name="w")
            opt = pstrain.optimizers.SGD(0.5)

        async def step(ids):
            rows = await pstrain.embedding_lookup(table, ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(np.ones_like(rows), ids), table)])
            return rows

        rvs = [coordinator.schedule(step, args=(np.array([i, i + 1], np.int64),)) for i in range(10)]
        await coordinator.join()
        first = await rvs[0]  # id 0 is this closure's alone (id 1 may be updated already)
        np.testing.assert_array_equal(first[0], _init([0], dim=8)[0])
        assert await table.size() == 11
        # 0 was updated once, 1..9 twice, 10 once.
        rows = await table.lookup(np.arange(11), training=False)
        np.testing.assert_allclose(rows[0], _init([0], 8)[0] - 0.5, rtol=1e-6)
        np.testing.assert_allclose(rows[5], _init([5], 8)[0] - 1.0, rtol=1e-6)
        await coordinator.close()


async def test_bad_configurations_and_ids_are_refused_with_clear_errors():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        with pytest.raises(InvalidArgumentError, match="strategy.scope"):
            pstrain.DynamicEmbedding(4)
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            with pytest.raises(InvalidArgumentError, match="admit_after or admit_probability"):
                pstrain.DynamicEmbedding(4, admit_after=2, admit_probability=0.5)
            with pytest.raises(InvalidArgumentError, match="^DynamicEmbedding eviction .*got 'fifo'"):
                pstrain.DynamicEmbedding(4, eviction="fifo")  # the option's name, not the wire's
            with pytest.raises(InvalidArgumentError, match="initializer"):
                pstrain.DynamicEmbedding(4, initializer=pstrain.initializers.GlorotUniform())
            with pytest.raises(InvalidArgumentError, match="dim"):
                pstrain.DynamicEmbedding(0)
            with pytest.raises(InvalidArgumentError, match="float32 or float64, got float16"):
                pstrain.DynamicEmbedding(4, dtype="float16")  # no table kernel takes it
            table = pstrain.DynamicEmbedding(4, name="ok")
            opt = pstrain.optimizers.SGD(0.1)
        with pytest.raises(InvalidArgumentError, match="integers"):
            await table.lookup([1.5])
        with pytest.raises(InvalidArgumentError, match="IndexedSlices"):
            await opt.apply_gradients([(np.ones((2, 4)), table)])
        with pytest.raises(InvalidArgumentError):
            await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((2, 3)), [1, 2]), table)])
        assert await table.size() == 0  # nothing changed

    with pytest.raises(InvalidArgumentError, match="float32 or float64, got float16"):
        TableConfig(dim=4, dtype="float16")  # what a ps refuses a dyn/create of, sent by hand


async def test_ids_in_any_order_are_served_and_a_repeated_id_is_refused_by_the_ps():
    """Clients send each ps its distinct ids in the order first seen (no sort); the ps
    checks they are distinct, and refuses a repeated id, changing nothing."""

    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="order")
            opt = pstrain.optimizers.SGD(1.0)
        ids = np.array([9, -3, 9, 2**62, -3, 7], np.int64)
        rows = await table.lookup(ids)
        assert np.array_equal(rows, _init(ids))
        grad = np.arange(24, dtype=np.float32).reshape(6, 4)
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
        after = await table.lookup(np.array([7, 2**62, -3, 9], np.int64), training=False)
        summed = {9: grad[0] + grad[2], -3: grad[1] + grad[4], 2**62: grad[3], 7: grad[5]}
        for got, key in zip(after, [7, 2**62, -3, 9]):
            assert np.array_equal(got, _init([key])[0] - summed[key])
        channel = table.channel(0)
        # a repeat among ids without a row, and among ids with one (checked apart on the ps)
        for repeated in ([5, 1, 5], [7, 9, 7], [2**62, 5, -3, 5]):
            with pytest.raises(InvalidArgumentError, match="distinct"):
                await channel.request(
                    LookupTable(name=table.key, ids=np.array(repeated, np.int64), train=True)
                )
            with pytest.raises(InvalidArgumentError, match="distinct"):
                await channel.request(
                    ApplyGradients(
                        rule=OptimizerRule(kind="sgd", learning_rate=1.0),
                        prefix=opt.name,
                        grads=[],
                        tables=[
                            (table.key, np.array(repeated, np.int64), np.ones((len(repeated), 4), np.float32))
                        ],
                    )
                )
        assert await table.size() == 4  # neither refused request changed anything
        again = await table.lookup(np.array([7, 2**62, -3, 9], np.int64), training=False)
        assert np.array_equal(again, after)


async def test_metrics_show_rows_admitted_evicted_and_bytes_per_table():

    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="m", capacity=5)
        await table.lookup(np.arange(8))
        async with aiohttp.ClientSession() as session:
            async with session.get(
                f"http://{cluster.ps[0].address}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
            ) as resp:
                text = await resp.text()
        assert 'pstrain_table_rows{role="ps",table="m",task="0"} 5.0' in text, text
        assert 'pstrain_table_admitted_total{role="ps",table="m",task="0"} 5.0' in text
        assert 'pstrain_table_evicted_total{role="ps",table="m",task="0"} 0.0' in text
        assert 'pstrain_table_bytes{role="ps",table="m",task="0"}' in text


async def test_a_checkpoint_of_a_dynamic_table_restores_bit_for_bit_into_1_2_and_3_ps(tmp_path):
    ids = np.array([5, -9, 2**62, 77, 3, 123456789, -(2**63), 11], np.int64)
    grad = np.linspace(-1, 1, ids.size * 4, dtype=np.float32).reshape(ids.size, 4)
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="emb", capacity=100)
            opt = pstrain.optimizers.Adagrad(0.1)
        await table.lookup(ids)
        for _ in range(2):
            await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
        saved_ids, saved_rows = await table.export()
        path = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "c"))
        acc = {k: v for k, v in pstrain.checkpoint.load_variables(path).items()}
        np.testing.assert_array_equal(acc["model/emb/ids"], saved_ids)
        np.testing.assert_array_equal(acc["model/emb/rows"], saved_rows)
        accumulator = acc["model/emb/slot:optimizer/accumulator"]
        np.testing.assert_allclose(accumulator, 0.1 + 2 * grad[np.argsort(ids)] ** 2, rtol=1e-6)
        assert await table.export_to(str(tmp_path / "serve.safetensors")) == ids.size
        from safetensors.numpy import load_file

        served = load_file(str(tmp_path / "serve.safetensors"))
        np.testing.assert_array_equal(served["ids"], saved_ids)
        np.testing.assert_array_equal(served["rows"], saved_rows)

    for num_ps in (1, 2, 3):
        async with InProcessCluster(
            num_ps=num_ps, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
        ) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            with strategy.scope():
                fresh = pstrain.DynamicEmbedding(4, name="other-name", capacity=100)
                opt2 = pstrain.optimizers.Adagrad(0.1, name="opt2")
            await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(path)
            got_ids, got_rows = await fresh.export()
            np.testing.assert_array_equal(got_ids, saved_ids)
            np.testing.assert_array_equal(got_rows, saved_rows)  # bit for bit
            held = [len(next(iter(ps.tables.values()))) for ps in cluster.ps]
            assert held == [int(np.sum(shard_of(ids, num_ps) == k)) for k in range(num_ps)]
            # The slots came back too: one more step equals one more step on the original.
            await opt2.apply_gradients([(pstrain.IndexedSlices(grad, ids), fresh)])
            a = accumulator + grad[np.argsort(ids)] ** 2
            expected = saved_rows - 0.1 * grad[np.argsort(ids)] / np.sqrt(a + 1e-7)
            np.testing.assert_allclose((await fresh.export())[1], expected, rtol=1e-5)


async def test_a_table_with_a_capacity_restored_into_a_fresh_job_trains_from_its_workers(tmp_path):
    """A restore shares a table's capacity by the rows each ps restored, so a shard's share
    is no longer the one its creator gives it; the workers of the new job, which never saw
    the restore, still reach the shards (their first request creates them if missing)."""
    ids = np.arange(0, 3000, 97, dtype=np.int64)  # 31 ids, split unevenly over 2 ps
    grad = np.linspace(-1, 1, ids.size * 4, dtype=np.float32).reshape(ids.size, 4)

    def model(strategy: pstrain.ParameterServerStrategy) -> tuple[object, object, object]:
        with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="emb", capacity=40)
            opt = pstrain.optimizers.Adagrad(0.1)
        return table, opt, pstrain.Checkpoint(model={"emb": table}, optimizer=opt)

    async def train(coordinator: pstrain.ClusterCoordinator, table: object, opt: object) -> None:
        async def step() -> None:
            await table.lookup(ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])

        await coordinator.schedule(step)

    root = {"checkpoint_root": str(tmp_path)}
    options = {"num_ps": 2, "num_workers": 1, "token": TOKEN, "ps_options": root}
    async with InProcessCluster(**options) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        table, opt, ckpt = model(strategy)
        await train(coordinator, table, opt)
        path = await ckpt.save(str(tmp_path / "c"))
        await train(coordinator, table, opt)  # what the restored job's step must give
        want_ids, want_rows = await table.export()
        await coordinator.close()
    async with InProcessCluster(**options) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        table, opt, ckpt = model(strategy)
        await ckpt.restore(path)
        shares = [next(iter(ps.tables.values())).config.capacity for ps in cluster.ps]
        assert sum(shares) == 40 and shares != [20, 20]  # shared by the rows restored
        await train(coordinator, table, opt)
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)
        await coordinator.close()


async def test_the_jax_and_pytorch_adapters_take_a_dynamic_table():
    import torch

    ids = np.array([[2**50, 7], [7, -3]], np.int64)
    unique = np.unique(ids)
    counts = np.array([np.sum(ids == i) for i in unique], np.float32)[:, None]
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            jt = pstrain.DynamicEmbedding(4, name="jax")
            tt = pstrain.DynamicEmbedding(4, name="torch")
            opt = pstrain.optimizers.SGD(0.5)

            class Net(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.emb = ptorch.Embedding(None, 4, table=tt)

            net = Net()
            remote = ptorch.RemoteModule(net)

        def loss_fn(params):
            return params["emb"].sum()

        loss, grads = await pjax.value_and_grad(loss_fn)({"emb": pjax.lookup(jt, ids)})
        np.testing.assert_allclose(loss, _init(ids.reshape(-1)).sum(), rtol=1e-5)
        await opt.apply_gradients(grads)
        np.testing.assert_allclose(await jt.lookup(unique), _init(unique) - 0.5 * counts, rtol=1e-5)

        await remote.pull({net.emb: ids})
        net.emb(ids).sum().backward()
        await opt.apply_gradients(remote.gradients())
        np.testing.assert_allclose(await tt.lookup(unique), _init(unique) - 0.5 * counts, rtol=1e-5)


@pytest.mark.timeout(120)
def test_the_id_index_agrees_with_a_dict_under_any_inserts_and_deletes():

    ids64 = st.integers(-(2**63), 2**63 - 1)

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.tuples(st.booleans(), st.lists(ids64, max_size=40)), max_size=30))
    def check(ops):
        index, model, row = IdIndex(4), {}, 0
        for insert, batch in ops:
            batch = list(dict.fromkeys(batch))  # unique within a batch
            arr = np.array(batch, np.int64)
            if insert:
                new = np.array([i for i in batch if i not in model], np.int64)
                rows = np.arange(row, row + new.size)
                index.insert(new, rows)
                model.update(zip(new.tolist(), rows.tolist()))
                row += new.size
            else:
                got = index.delete(arr)
                assert got.tolist() == [model.pop(i, -1) for i in batch]
            probe = np.array(batch + list(model)[:20], np.int64)
            assert index.get(probe).tolist() == [model.get(i, -1) for i in probe.tolist()]
            assert len(index) == len(model)
        keys, vals = index.items()
        assert dict(zip(keys.tolist(), vals.tolist())) == model

    check()


def test_sightings_are_remembered_for_at_most_max_candidates_ids_newest_kept():

    t = DynamicTable("t", TableConfig(dim=2, admit_after=2, max_candidates=100))
    for lo in range(0, 1000, 50):  # 1,000 ids seen once each, 50 per lookup
        t.lookup(np.arange(lo, lo + 50, dtype=np.int64), train=True)
        assert t.candidates <= 100
    assert len(t) == 0
    t.lookup(np.arange(950, 1000, dtype=np.int64), train=True)  # the newest: second sighting
    assert len(t) == 50
    t.lookup(np.arange(0, 50, dtype=np.int64), train=True)  # forgotten: a first sighting again
    assert len(t) == 50


def test_the_sightings_kept_stay_bounded_however_many_ids_are_admitted_over_time():
    """An admitted id's sighting slot is not reused: without moving the counted ones down,
    the slots grew with every id ever admitted (a shard that admits as fast as it evicts
    grew without end) while at most a batch of ids was counted at once."""

    t = DynamicTable("t", TableConfig(dim=2, admit_after=2, capacity=200))
    sizes = []
    for lo in range(0, 40_000, 100):  # each id seen twice in a row, then never again
        ids = np.arange(lo, lo + 100, dtype=np.int64)
        t.lookup(ids, train=True)
        assert t.candidates == 100
        t.lookup(ids, train=True)
        assert t.candidates == 0 and np.array_equal(np.sort(t.export()["ids"])[-100:], ids)
        sizes.append(t.statistics()["bytes"])
    assert t.admitted == 40_000 and len(t) == 200
    assert max(sizes[100:]) <= max(sizes[:10]), (sizes[:10], sizes[-1])


def test_sightings_moved_down_keep_their_order_so_the_oldest_are_still_forgotten_first():

    t = DynamicTable("t", TableConfig(dim=2, admit_after=2, max_candidates=1000))
    singles = np.arange(1_000_000, 1_000_900, dtype=np.int64)  # each seen once, oldest first
    for r, single in enumerate(singles):  # between them, ids admitted at once: their slots
        ids = np.arange(r * 20, r * 20 + 20, dtype=np.int64)  # are moved past many times
        t.lookup(np.append(ids, single), train=True)
        t.lookup(ids, train=True)
    assert t.candidates == 900 and len(t) == 18_000
    t.lookup(np.arange(-101, 0, dtype=np.int64), train=True)  # past the limit: half forgotten
    assert t.candidates <= 1000
    t.lookup(singles[-400:], train=True)  # the newest kept: a second sighting admits them
    assert np.all(t.positions(singles[-400:]) >= 0)
    t.lookup(singles[:500], train=True)  # the oldest forgotten: a first sighting again
    assert np.all(t.positions(singles[:500]) < 0)


def test_rows_a_lookup_admits_are_in_the_next_delta_even_before_an_update():
    """A row is state from its admission on (a restore without it would answer the default
    until the id is admitted again), so a delta holds it though no update touched it yet."""

    t = DynamicTable("t", TableConfig(dim=2, capacity=4))
    t.lookup(np.array([1, 2, 3], np.int64), train=True)
    since = t.clock.mark()
    t.lookup(np.array([3, 4, 5], np.int64), train=True)  # 4 and 5 admitted, 1 evicted
    changes = t.changes(since)
    assert changes is not None
    save, gone = changes
    ids = np.concatenate(list(save["ids"].blocks()))
    rows = np.concatenate(list(save["rows"].blocks()))
    assert sorted(ids.tolist()) == [4, 5] and gone.tolist() == [1]
    np.testing.assert_array_equal(rows[np.argsort(ids)], _init([4, 5], dim=2))
    t.end_snapshot(save)


async def test_a_dynamic_table_saved_during_training_is_a_state_it_was_in(tmp_path, monkeypatch):

    monkeypatch.setattr(snapshots, "BLOCK_BYTES", 4096)  # many blocks: updates land before the writer
    ids = np.arange(1, 20_001, dtype=np.int64) * 7919
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(8, name="live", capacity=19_000)
            opt = pstrain.optimizers.SGD(1.0)
        await table.lookup(ids[:18_000])
        states = [await table.export()]

        async def train():
            for k in range(6):  # every row changes, and new ids evict old ones
                batch = ids[k * 300 : k * 300 + 18_000] if k < 5 else ids[2_000:]
                await table.lookup(batch)
                await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((batch.size, 8)), batch), table)])
                states.append(await table.export())

        path, _ = await asyncio.gather(pstrain.Checkpoint(t=table).save(str(tmp_path / "c")), train())
        saved = pstrain.checkpoint.load_variables(path)
        match = [
            i
            for i, (i_ids, i_rows) in enumerate(states)
            if np.array_equal(i_ids, saved["t/ids"]) and np.array_equal(i_rows, saved["t/rows"])
        ]
        assert match, "the saved table is no state the table was in"


def test_a_table_snapshot_holds_the_table_as_it_was_while_rows_change_evict_and_grow(monkeypatch):

    monkeypatch.setattr(snapshots, "BLOCK_BYTES", 1024)
    t = DynamicTable("t", TableConfig(dim=4, capacity=3000))
    ids = np.arange(1, 5001, dtype=np.int64) * 31
    t.lookup(ids[:2500], train=True)
    slots = {"accumulator": ("opt/accumulator", 0.1)}
    t.apply(RULES["adagrad"], ids[:2500], np.ones((2500, 4), np.float32), slots, {"learning_rate": 0.1}, 1)
    before = {k: v.copy() for k, v in t.export().items()}
    save = t.snapshot()
    readers = {k: s.blocks() for k, s in save.items()}
    got = {k: [next(r)] for k, r in readers.items()}  # the writer has taken the first block
    t.lookup(ids[2000:5000], train=True)  # new rows, evictions, growth
    t.apply(
        RULES["adagrad"],
        ids[2000:5000],
        np.full((3000, 4), 2.0, np.float32),
        slots,
        {"learning_rate": 0.1},
        2,
    )
    for k, r in readers.items():
        got[k].extend(r)
    arrays = {k: np.concatenate(v) for k, v in got.items()}
    live = arrays["live"]
    order = np.argsort(arrays["ids"][live])
    np.testing.assert_array_equal(arrays["ids"][live][order], np.sort(before["ids"]))
    by_id = np.argsort(before["ids"])
    np.testing.assert_array_equal(arrays["rows"][live][order], before["rows"][by_id])
    np.testing.assert_array_equal(
        arrays["slot:opt/accumulator"][live][order], before["slot:opt/accumulator"][by_id]
    )
    t.end_snapshot(save)
    assert not t.saves


async def test_a_restore_keeps_the_table_counters_of_the_ps_it_lands_on(tmp_path):
    # /metrics exports them as Prometheus counters: within one ps process they never go down
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(2, name="emb", capacity=4)
        await table.lookup(np.arange(3, dtype=np.int64))
        path = await pstrain.Checkpoint(model={"emb": table}).save(str(tmp_path / "c"))
        await table.lookup(np.arange(10, 16, dtype=np.int64))  # evicts the 3, admits 4 of 6
        before = await table.statistics()
        assert before["admitted"] == 7 and before["evicted"] == 3
        await pstrain.Checkpoint(model={"emb": table}).restore(path)
        after = await table.statistics()
        assert after["rows"] == 3
        assert after["admitted"] == before["admitted"] and after["evicted"] == before["evicted"]


async def test_string_ids_are_refused_with_how_to_hash_them(cluster):

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(2, name="words")
    with pytest.raises(
        pstrain.errors.InvalidArgumentError,
        match=r"ids must be integers, got <U5 \(strings\?\).*hashlib.blake2b",
    ) as info:
        await table.lookup(np.array(["apple", "pear"]))
    # the hint, as written, gives valid ids
    hint = str(info.value).split("e.g. ", 1)[1]
    ids = np.array([eval(hint, {"hashlib": hashlib, "key": k}) for k in ("apple", "pear")])
    assert (await table.lookup(ids)).shape == (2, 2)


def test_an_update_takes_the_rows_its_lookup_found_only_while_they_are_still_its_ids():
    """The ps's update of ids it just looked up reuses that lookup's rows (no second
    probe). Twin tables get the same calls; one updates through that reuse, the other
    probes afresh: after evictions that hand a looked-up id's row to another id, and
    admissions of ids that had no row at the lookup, both hold the same rows."""

    config = TableConfig(dim=4, capacity=40, admit_after=2)
    reused, fresh = DynamicTable("t", config), DynamicTable("t", config)
    slots = {"accumulator": ("opt/accumulator", 0.1)}
    rng = np.random.default_rng(7)
    step = 0

    def both(ids, other=None):
        nonlocal step
        step += 1
        grad = rng.standard_normal((ids.size, 4)).astype(np.float32)
        for table in (reused, fresh):
            table.lookup(ids, train=True)
            if other is not None:  # another worker's lookup between this lookup and its update
                table.lookup(other, train=True)
        pos = reused.locate_update(ids)
        assert pos is not None
        reused.apply(RULES["adagrad"], ids, grad, slots, {"learning_rate": 0.1}, step, pos)
        fresh.apply(RULES["adagrad"], ids, grad, slots, {"learning_rate": 0.1}, step)
        a, b = reused.export(), fresh.export()
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    ids = np.arange(1, 31, dtype=np.int64) * 7
    both(ids)  # first sightings: nothing admitted, every row -1
    both(ids)  # admitted now
    late = np.arange(2000, 2006, dtype=np.int64)
    both(late, other=late)  # no rows at the lookup; admitted by the next: looked for again
    both(ids[::-1].copy())  # another order: not the lookup's ids, probed afresh
    both(ids[:10], other=ids[10:20])  # ids came in between: nothing left
    newcomers = np.arange(1000, 1040, dtype=np.int64)
    both(ids[:10], other=newcomers)  # sighted once: no row yet, nothing evicted
    assert reused.evicted == 0
    both(ids[:10], other=newcomers)  # admitted past the capacity: rows evicted and reused
    assert reused.evicted > 0 and reused.evicted == fresh.evicted
    both(np.concatenate([ids[:5], newcomers[:5]]), other=ids[20:30])
