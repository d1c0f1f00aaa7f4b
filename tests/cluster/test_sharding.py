"""Partitioners (TF's exact counts), sharded variables and embedding lookups on real ps."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain.errors import InvalidArgumentError
from pstrain.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "partitioner, shape, dtype, expected",
    [
        (MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), np.float32, [2, 1]),
        (MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), np.float32, [6, 1]),
        (MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2), (1024, 1024), np.float32, [2, 1]),
        (MinSizePartitioner(min_shard_bytes=64 << 20, max_shards=2), (10,), np.int64, [1]),
        (MaxSizePartitioner(max_shard_bytes=4), (6, 1), np.float32, [6, 1]),
        (MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), np.float32, [2, 1]),
        (MaxSizePartitioner(max_shard_bytes=1024), (6, 1), np.float32, [1, 1]),
        (FixedShardsPartitioner(2), (10, 3), np.float32, [2, 1]),
        (FixedShardsPartitioner(4), (3,), np.float32, [3]),
    ],
)
def test_partitioner_counts_match_tf(partitioner, shape, dtype, expected):
    assert partitioner(shape, np.dtype(dtype)) == expected


def test_partitioner_validation():
    with pytest.raises(InvalidArgumentError):
        MinSizePartitioner(min_shard_bytes=0)
    with pytest.raises(InvalidArgumentError):
        MaxSizePartitioner(max_shard_bytes=0)
    with pytest.raises(InvalidArgumentError):
        FixedShardsPartitioner(0)


def sharded_strategy(ps, partitioner):
    spec = {"ps": [s.address for s in ps], "worker": ["127.0.0.1:9"]}
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=partitioner
    )


async def test_div_layout_names_placement_and_values(ps_pair):
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(2))
    async with strategy.scope():
        v = pstrain.Variable(np.arange(10, dtype=np.float32).reshape(5, 2), name="v")
    assert isinstance(v, pstrain.ShardedVariable) and v.shape == (5, 2) and v.name == "v"
    assert [p.name for p in v.variables] == ["v/part_0", "v/part_1"]
    np.testing.assert_array_equal(await v.variables[0].numpy(), [[0, 1], [2, 3], [4, 5]])
    np.testing.assert_array_equal(await v.variables[1].numpy(), [[6, 7], [8, 9]])
    np.testing.assert_array_equal(await v.numpy(), np.arange(10).reshape(5, 2))

    strategy4 = sharded_strategy(ps_pair, FixedShardsPartitioner(4))
    async with strategy4.scope():
        w = pstrain.Variable(np.arange(10, dtype=np.float32), name="w")
        small = pstrain.Variable(np.arange(3, dtype=np.float32), name="small")
        scalar = pstrain.Variable(1.0, name="scalar")
    assert [p.shape[0] for p in w.variables] == [3, 3, 2, 2]
    assert [p.ps_index for p in w.variables] == [0, 1, 0, 1]
    assert [p.shape[0] for p in small.variables] == [1, 1, 1]
    assert [p.ps_index for p in small.variables] == [0, 1, 0]  # the counter carries on
    assert isinstance(scalar, pstrain.Variable)  # rank 0: never partitioned
    with strategy4.scope():  # TF's order: colocation only inside the scope
        with strategy4.extended.colocate_vars_with(scalar):
            colocated = pstrain.Variable(np.zeros(8, np.float32), name="colocated")
    assert isinstance(colocated, pstrain.Variable) and colocated.device == scalar.device


async def test_initializer_is_called_per_part_on_its_ps(ps_pair):
    class Identity(pstrain.initializers.Initializer):
        pass

    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(2))
    init = pstrain.initializers.RandomUniform(-1, 1, seed=3)
    async with strategy.scope():
        table = pstrain.Variable(init, shape=(1000, 8), name="table")
    parts = [await p.numpy() for p in table.variables]
    assert parts[0].shape == (500, 8) and not np.array_equal(parts[0], parts[1])
    np.testing.assert_array_equal(parts[1], init((500, 8), np.float32, offset=(500, 0), full_shape=(1000, 8)))
    ch = rpc.Channel(ps_pair[1].address, token=TOKEN, task="ps1")
    stats = await ch.statistics()
    assert stats["requests"]["vars/create"]["bytes_in"] < 1000  # 16 KB part generated there
    await ch.close()


@pytest.mark.parametrize(
    "init",
    [
        pstrain.initializers.HeNormal(seed=1),
        pstrain.initializers.GlorotNormal(seed=2),
        pstrain.initializers.Orthogonal(gain=0.5, seed=3),
        pstrain.initializers.Identity(2.0),
    ],
    ids=lambda i: type(i).__name__,
)
async def test_keras_initializers_make_on_each_ps_the_rows_of_the_whole(ps_pair, init):
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(3))
    async with strategy.scope():
        w = pstrain.Variable(init, shape=(10, 6), name="w")
    assert len(w.variables) == 3  # each part from its rows' stream, as a local call makes it
    local = [init((n, 6), np.float32, offset=(o, 0), full_shape=(10, 6)) for o, n in ((0, 4), (4, 3), (7, 3))]
    np.testing.assert_array_equal(await w.numpy(), np.concatenate(local))
    if not isinstance(init, (pstrain.initializers.HeNormal, pstrain.initializers.GlorotNormal)):
        np.testing.assert_array_equal(await w.numpy(), init((10, 6), np.float32))  # rows of the whole


async def test_invalid_partitioner_output_names_variable_partitioner(ps_pair):
    for bad in (
        lambda shape, dtype: None,
        lambda shape, dtype: [],
        lambda shape, dtype: [0, 1],
        lambda shape, dtype: [2, 2],
    ):
        strategy = sharded_strategy(ps_pair, bad)
        with pytest.raises(InvalidArgumentError, match="variable_partitioner"):
            with strategy.scope():
                pstrain.Variable(np.zeros((4, 2), np.float32))


async def test_sharded_assign_scatter_and_sparse_read(ps_pair):
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(3))
    async with strategy.scope():
        v = pstrain.Variable(np.zeros((11, 2), np.float32), name="v")
    assert [p.shape[0] for p in v.variables] == [4, 4, 3]
    full = np.arange(22, dtype=np.float32).reshape(11, 2)
    assert await v.assign(full) is v
    await v.assign_add(np.ones((11, 2)))
    await v.assign_sub(np.full((11, 2), 2.0))
    np.testing.assert_array_equal(await v.numpy(), full - 1)
    await v.scatter_add(pstrain.IndexedSlices(np.ones((4, 2)), [0, 4, 10, 10]))
    await v.scatter_update(pstrain.IndexedSlices(np.full((2, 2), 7.0), [3, 8]))
    expected = full - 1
    expected[[0, 4]] += 1
    expected[10] += 2
    expected[[3, 8]] = 7
    np.testing.assert_array_equal(await v.numpy(), expected)
    np.testing.assert_array_equal(await v.sparse_read([10, 0, 3]), expected[[10, 0, 3]])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        await v.scatter_add(pstrain.IndexedSlices(np.ones((1, 2)), [11]))

    class M(pstrain.Module):
        def __init__(self):
            super().__init__()
            self.table = v

    assert [p.name for p in M().variables] == ["v/part_0", "v/part_1", "v/part_2"]


async def test_embedding_lookup_one_request_per_ps_and_no_full_read(ps_pair):
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(3))
    async with strategy.scope():
        table = pstrain.Variable(np.arange(1, 11, dtype=np.float32).reshape(5, 2), name="t")
    assert [p.shape[0] for p in table.variables] == [2, 2, 1]  # on ps 0, 1, 0
    channels = [rpc.Channel(s.address, token=TOKEN, task=f"ps{i}") for i, s in enumerate(ps_pair)]

    async def counts():
        out = []
        for ch in channels:
            reqs = (await ch.statistics())["requests"]
            out.append(
                (reqs.get("vars/sparse_read", {}).get("count", 0), reqs.get("vars/read", {}).get("count", 0))
            )
        return out

    before = await counts()
    rows = await pstrain.embedding_lookup(table, [0, 3, 4])
    np.testing.assert_array_equal(rows, [[1, 2], [7, 8], [9, 10]])
    after = await counts()
    assert [a[0] - b[0] for a, b in zip(after, before)] == [1, 1]  # one gather per ps
    assert [a[1] - b[1] for a, b in zip(after, before)] == [0, 0]  # never a full read
    ids = np.array([[4, 4, 0], [1, 2, 4]])
    out = await pstrain.embedding_lookup(table, ids)
    assert out.shape == (2, 3, 2)
    np.testing.assert_array_equal(out, (np.arange(1, 11).reshape(5, 2))[ids])
    np.testing.assert_array_equal(await pstrain.embedding_lookup(table.variables, [4, 0]), [[9, 10], [1, 2]])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        await pstrain.embedding_lookup(table, [5])
    plain = strategy_for(ps_pair[0])
    async with plain.scope():
        whole = pstrain.Variable(np.eye(3, dtype=np.float32), name="whole")
    np.testing.assert_array_equal(await pstrain.embedding_lookup(whole, [2, 2]), np.eye(3)[[2, 2]])
    for ch in channels:
        await ch.close()


async def test_read_variables_reads_sharded_and_whole_variables_in_one_request_per_ps(ps_pair):
    """A model's dense layers, sharded over 2 ps, read each step: their parts travel in the
    same request as the other variables of their ps, not in a request per variable."""
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(2))
    async with strategy.scope():
        w = pstrain.Variable(np.arange(12, dtype=np.float32).reshape(6, 2), name="w")
        b = pstrain.Variable(np.arange(3, dtype=np.float32), name="b")
        c = pstrain.Variable(7.0, name="c")  # a scalar: one part
    local = pstrain.Variable(np.ones(2, np.float32))
    assert [len(v.variables) for v in (w, b)] == [2, 2]
    channels = [rpc.Channel(s.address, token=TOKEN, task=f"ps{i}") for i, s in enumerate(ps_pair)]

    async def reads():
        return [(await ch.statistics())["requests"].get("vars/read", {}).get("count", 0) for ch in channels]

    await pstrain.read_variables([w, b, c])  # created on their ps
    before = await reads()
    got = await pstrain.read_variables([w, local, b, c, w])
    after = await reads()
    assert [x - y for x, y in zip(after, before)] == [1, 1]  # one request per ps
    np.testing.assert_array_equal(got[0], np.arange(12).reshape(6, 2))
    np.testing.assert_array_equal(got[1], np.ones(2))
    np.testing.assert_array_equal(got[2], np.arange(3))
    assert got[3] == 7.0
    np.testing.assert_array_equal(got[4], got[0])
    with pytest.raises(InvalidArgumentError, match="takes variables, got ndarray"):
        await pstrain.read_variables([w, np.zeros(2)])
    for ch in channels:
        await ch.close()


async def test_embedding_lookup_sends_only_deduplicated_rows(ps_server):
    strategy = sharded_strategy([ps_server], FixedShardsPartitioner(1))
    async with strategy.scope():
        table = pstrain.Variable(np.zeros((100_000, 16), np.float32), name="big")
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    ids = np.repeat(np.arange(100), 50)  # 5,000 ids, 100 distinct
    await pstrain.embedding_lookup(table, ids)
    stats = (await ch.statistics())["requests"]["vars/sparse_read"]
    assert stats["bytes_out"] < 100 * 16 * 4 + 1000
    await ch.close()


def test_sharded_variable_validation():
    a = pstrain.Variable(np.zeros((2, 2), np.float32))
    b = pstrain.Variable(np.zeros((2, 3), np.float32))
    c = pstrain.Variable(np.zeros((2, 2), np.float64))
    with pytest.raises(TypeError, match="non-empty list"):
        pstrain.ShardedVariable([])
    with pytest.raises(InvalidArgumentError, match="same shapes except"):
        pstrain.ShardedVariable([a, b])
    with pytest.raises(InvalidArgumentError, match="same dtype"):
        pstrain.ShardedVariable([a, c])
    assert pstrain.ShardedVariable([a, a]).shape == (4, 2)


async def test_a_callable_initial_value_is_asked_for_each_shard(ps_pair):
    """TF: a callable of known shape and dtype gets partition_shape and partition_offset;
    one that refuses them is called once and sliced."""

    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(
            {"ps": [s.address for s in ps_pair], "worker": ["127.0.0.1:9"]}, token=TOKEN
        ),
        variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2),
    )
    calls = []

    def per_shard(partition_shape=None, partition_offset=None):
        calls.append((partition_shape, partition_offset))
        return np.full(partition_shape, partition_offset[0], np.float32)

    whole = []

    def plain():
        whole.append(1)
        return np.arange(10, dtype=np.float32).reshape(5, 2)

    uniform = pstrain.initializers.RandomUniform(-1.0, 1.0, seed=3)
    async with strategy.scope():
        a = pstrain.Variable(per_shard, shape=(5, 2), dtype=np.float32)
        b = pstrain.Variable(plain, shape=(5, 2), dtype=np.float32)
        c = pstrain.Variable(
            functools.partial(uniform, shape=(5, 2), dtype=np.float32), shape=(5, 2), dtype=np.float32
        )
        d = pstrain.Variable(uniform, shape=(5, 2), dtype=np.float32)  # generated on the ps
    assert calls == [((3, 2), (0, 0)), ((2, 2), (3, 0))]
    assert (await a.numpy())[:, 0].tolist() == [0, 0, 0, 3, 3]
    assert whole == [1] and (await b.numpy()).tolist() == np.arange(10).reshape(5, 2).tolist()
    np.testing.assert_array_equal(await c.numpy(), await d.numpy())  # the same shards


@pytest.mark.parametrize("shape", [(-1, 3), (2.5, 3), "ab", 5, (True, 2)])
async def test_a_bad_shape_is_refused_by_name_in_and_out_of_a_scope(ps_pair, shape):
    """numpy's "negative dimensions are not allowed" named neither the variable's shape nor
    what was given; in a scope, the shape went on to the ps."""
    message = r"a variable's shape must be a tuple of whole numbers of 0 or more, got "
    with pytest.raises(InvalidArgumentError, match=message):
        pstrain.Variable(pstrain.initializers.Zeros(), shape=shape)
    strategy = strategy_for(ps_pair[0])
    with strategy.scope(), pytest.raises(InvalidArgumentError, match=message):
        pstrain.Variable(pstrain.initializers.Zeros(), shape=shape)
    assert pstrain.Variable(pstrain.initializers.Zeros(), shape=np.array([2, 3])).shape == (2, 3)


async def test_indexing_a_variable_gives_numpys_result_reading_only_the_rows_it_needs(ps_pair):
    """TF's slicing of a sharded variable (``test_slicing``'s forms: steps either way,
    clamping, empty slices, ``...``, ``None``, masks, other axes; an integer past the rows
    an IndexError "out of bounds"), awaited; a plain variable alike."""
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(3))
    full = np.arange(40, dtype=np.float32).reshape(10, 4)
    async with strategy.scope():
        v = pstrain.Variable(full.copy(), name="v")
        whole = pstrain.Variable(np.float32(3.0), name="scalar")
    mask = np.arange(10) % 3 == 0
    for index in [
        np.s_[1:7], np.s_[::-1], np.s_[8:2:-2], np.s_[-3:], np.s_[100:], np.s_[3:3], np.s_[5], np.s_[-1],
        np.s_[..., 1], np.s_[:, None, 2], np.s_[2:4, 1:3], np.s_[mask], np.s_[[1, 3, 3]], np.s_[0, 0],
        np.s_[[[9, 0], [0, 2]], 1], np.s_[np.array([], np.int64)], np.s_[()],
    ]:  # fmt: skip
        got = await v[index]
        np.testing.assert_array_equal(got, full[index], err_msg=repr(index))
    np.testing.assert_array_equal(await v.variables[0][1:3, 2], full[1:3, 2])  # a plain variable
    assert await whole[()] == 3.0
    with pytest.raises(IndexError, match="index 10 is out of bounds for axis 0 with size 10"):
        await v[10]
    with pytest.raises(IndexError, match="boolean index"):
        await v[np.array([True, False])]
    with pytest.raises(TypeError, match="not iterable"):
        list(v)
    with pytest.raises(TypeError, match="not iterable"):
        iter(v.variables[0])
    with pstrain.count_requests() as counts:
        assert (await v[5:7]).tolist() == full[5:7].tolist()  # rows 5 and 6: in one part
    assert sum(counts.per_task.values()) == 1


SCATTER = json.loads(
    (Path(__file__).resolve().parents[1] / "unit" / "references" / "tf_scatter.json").read_text()
)


@pytest.mark.parametrize("op", sorted(SCATTER["after"]))
@pytest.mark.parametrize("sharded", [True, False])
async def test_every_scatter_of_tfs_variable_on_the_ps_gives_tfs_rows(ps_pair, op, sharded):
    """add, sub, mul, div, min, max and update with repeated ids, on a variable split over
    three parts and on a whole one, against the rows TensorFlow's variable ended with
    (``references/make_references.py tf_scatter``)."""
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(3) if sharded else None)
    start = np.array(SCATTER["start"], np.float32)
    async with strategy.scope():
        v = pstrain.Variable(start.copy(), name="v")
    ids, values = np.array(SCATTER["ids"]), np.array(SCATTER["values"], np.float32)
    if op == "scatter_update":
        ids, values = ids[[0, 1, 3, 4]], values[[0, 1, 3, 4]]
    assert await getattr(v, op)(pstrain.IndexedSlices(values, ids)) is v
    np.testing.assert_allclose(await v.numpy(), SCATTER["after"][op], rtol=1e-6)


async def test_scatter_div_of_integers_and_batch_scatter_update(ps_pair):
    strategy = sharded_strategy(ps_pair, FixedShardsPartitioner(2))
    async with strategy.scope():
        counts = pstrain.Variable(np.full((4, 2), 8, np.int64), name="counts")
        w = pstrain.Variable(np.zeros((4, 2), np.float32), name="w")
    with pytest.raises(
        pstrain.errors.InvalidArgumentError, match="scatter_div of variable .* not floating point"
    ):
        await counts.scatter_div(pstrain.IndexedSlices(np.full((1, 2), 2, np.int64), [1]))
    assert (await counts.numpy()).tolist() == [[8, 8]] * 4  # nothing changed
    await counts.scatter_max(pstrain.IndexedSlices(np.array([[9, 1]], np.int64), [3]))
    assert (await counts.numpy())[3].tolist() == [9, 8]
    await w.batch_scatter_update(pstrain.IndexedSlices(np.ones((2, 2), np.float32), [0, 3]))
    assert (await w.numpy())[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    await w.variables[1].batch_scatter_update(pstrain.IndexedSlices(np.full((1, 2), 5.0, np.float32), [1]))
    assert (await w.numpy())[:, 0].tolist() == [1.0, 0.0, 0.0, 5.0]
