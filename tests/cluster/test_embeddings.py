"""Ranking models' tables (issue 61): jagged features, TF's pooled lookups with TF's rules,
a collection of tables with one request per ps per step, on real ps in this process.

The expected values of TF's rules were read off TensorFlow 2.21 on the same inputs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import pstrain
from pstrain import (
    EmbeddingCollection,
    JaggedTensor,
    KeyedJaggedTensor,
    SparseTensor,
    TableConfig,
    embedding_lookup_sparse,
    safe_embedding_lookup_sparse,
)
from pstrain.checkpoint import Checkpoint, load_variables
from pstrain.errors import InvalidArgumentError, NotFoundError
from pstrain.partitioners import FixedShardsPartitioner
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, strategy_for

pytestmark = pytest.mark.timeout(60)

PARAMS = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], np.float32)
# rows 0 and 2 have ids; row 1 and row 3 (the last) are empty
SP = SparseTensor([[0, 0], [0, 1], [2, 0]], [0, 1, 3], dense_shape=[4, 2])


def sharded_strategy(ps):
    spec = {"ps": [s.address for s in ps], "worker": ["127.0.0.1:9"]}
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN), variable_partitioner=FixedShardsPartitioner(2)
    )


class Ragged:
    """A TF RaggedTensor's parts (``values``, ``row_splits``), as TF hands them over."""

    def __init__(self, values, row_splits):
        self.values, self.row_splits = np.asarray(values), np.asarray(row_splits)


async def test_tf_lookups_follow_tfs_rules_on_a_sharded_table(ps_pair):
    async with sharded_strategy(ps_pair).scope():
        params = pstrain.Variable(PARAMS, name="params")
    assert isinstance(params, pstrain.ShardedVariable)
    got = await embedding_lookup_sparse(params, SP, None, combiner="sum")
    # TF: a row per bag up to the last non-empty one (its segment sum)
    np.testing.assert_array_equal(got, [[4, 6], [0, 0], [7, 8]])
    w = SparseTensor(SP.indices, [1.0, 0.0, 0.0], SP.dense_shape)
    for combiner in ("mean", "sqrtn"):  # a bag of total weight 0 gives 0 (div_no_nan)
        np.testing.assert_array_equal(
            await embedding_lookup_sparse(params, SP, w, combiner=combiner), [[1, 2], [0, 0], [0, 0]]
        )
    # TF's default combiner is "mean"
    np.testing.assert_array_equal(await embedding_lookup_sparse(params, SP, None), [[2, 3], [0, 0], [7, 8]])
    ragged_w = Ragged([1.0, 2.0, 3.0], [0, 2, 3, 3])
    np.testing.assert_allclose(
        await embedding_lookup_sparse(params, Ragged([0, 1, 3], [0, 2, 3, 3]), ragged_w, "sqrtn"),
        [[3.130495, 4.472136], [7, 8]],
        rtol=1e-6,
        atol=1e-6,
    )
    with pytest.raises(InvalidArgumentError, match=r"combiner must be one of"):
        await embedding_lookup_sparse(params, SP, None, combiner="max")
    with pytest.raises(InvalidArgumentError, match=r"id 4 out of range \[0, 4\)"):
        await embedding_lookup_sparse(params, SparseTensor([[0, 0]], [4], [1, 1]), None, "sum")
    with pytest.raises(InvalidArgumentError, match="same indices"):
        await embedding_lookup_sparse(params, SP, SparseTensor([[0, 0]], [1.0], [4, 2]))
    # TF's keyword arguments as TF code passes them; max_norm clips each looked-up row
    clipped = await pstrain.nn.embedding_lookup(params, [[1, 0]], max_norm=2.5, name="lookup")
    np.testing.assert_allclose(clipped, [[[1.5, 2.0], [1.0, 2.0]]], rtol=1e-6)  # |(3, 4)| = 5
    got = await embedding_lookup_sparse(params, SP, None, "sum", 2.5, name="f1", allow_fast_lookup=True)
    last = 2.5 * np.array([7.0, 8.0]) / np.hypot(7, 8)
    np.testing.assert_allclose(got, [[2.5, 4.0], [0, 0], last], rtol=1e-6)
    with pytest.raises(InvalidArgumentError, match="max_norm must be a positive"):
        await pstrain.nn.embedding_lookup(params, [0], max_norm=0.0)


async def test_the_safe_lookup_prunes_fills_and_keeps_the_batch_shape(ps_server):
    async with strategy_for(ps_server).scope():
        params = pstrain.Variable(PARAMS, name="params")
    w = SparseTensor(SP.indices, [1.0, 0.0, 0.0], SP.dense_shape)
    # weights of 0 or less are dropped unless the combiner is "sum"; empty bags give zeros
    np.testing.assert_array_equal(
        await safe_embedding_lookup_sparse(params, SP, w, "mean"), [[1, 2], [0, 0], [0, 0], [0, 0]]
    )
    negative = SparseTensor(SP.indices, [2.0, -1.0, 0.5], SP.dense_shape)
    np.testing.assert_array_equal(
        await safe_embedding_lookup_sparse(params, SP, negative, "sum"), [[-1, 0], [0, 0], [3.5, 4], [0, 0]]
    )
    bad_ids = SparseTensor(SP.indices, [0, -1, 3], SP.dense_shape)  # ids below 0 are dropped
    np.testing.assert_array_equal(
        await safe_embedding_lookup_sparse(params, bad_ids, None, "mean", default_id=2),
        [[1, 2], [5, 6], [7, 8], [5, 6]],
    )
    rank3 = SparseTensor([[0, 0, 0], [0, 1, 1], [1, 0, 0]], [0, 1, 3], [2, 2, 2])
    np.testing.assert_array_equal(
        await safe_embedding_lookup_sparse(params, rank3, None, "sum"), [[[1, 2], [3, 4]], [[7, 8], [0, 0]]]
    )


async def test_lookups_on_a_dynamic_table_pool_its_rows(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(3, name="dyn")
    ids = JaggedTensor.from_lists([[10, 2**40], [], [10]])
    # admitted first: outside training, ids not admitted read zeros
    rows = await table.lookup(np.array([10, 2**40]))
    assert np.all(np.abs(rows).sum(axis=1) > 0)
    got = await embedding_lookup_sparse(table, ids, None, combiner="sum", training=False)
    np.testing.assert_allclose(got, [rows[0] + rows[1], [0, 0, 0], rows[0]], rtol=1e-6, atol=1e-6)


async def test_the_safe_lookup_on_a_dynamic_table_keeps_negative_keys(cluster):
    """A dynamic table's ids are raw 64-bit keys (hashes among them), negative ones as valid
    as the rest: the safe lookup drops none of them for its sign (as TensorFlow
    Recommenders-Addons' dynamic safe_embedding_lookup_sparse; on a variable it drops ids
    below 0 as TF does, tested above). Weights of 0 or less and empty bags follow TF's rules."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(3, name="keys")
    keys = np.array([-(2**62), -5, 7], np.int64)
    rows = await table.lookup(keys)  # admitted first: outside training they would read zeros
    assert np.all(np.abs(rows).sum(axis=1) > 0)
    sp = SparseTensor([[0, 0], [0, 1], [1, 0], [3, 0]], [-(2**62), 7, -5, -5], dense_shape=[4, 2])
    got = await safe_embedding_lookup_sparse(table, sp, None, "sum", training=False)
    np.testing.assert_allclose(got, [rows[0] + rows[2], rows[1], [0, 0, 0], rows[1]], rtol=1e-6, atol=1e-6)
    weights = SparseTensor(sp.indices, [1.0, 0.0, 2.0, -1.0], sp.dense_shape)
    got = await safe_embedding_lookup_sparse(table, sp, weights, "mean", default_id=7, training=False)
    np.testing.assert_allclose(got, [rows[0], rows[1], rows[2], rows[2]], rtol=1e-6, atol=1e-6)


async def test_a_tf_style_lookup_gives_its_gradient_to_train_a_sharded_and_a_dynamic_table(ps_pair):
    """``with_gradient=True``: what TF's ``tape.gradient`` gives for a sparse lookup, as
    sparse rows an optimizer applies to the table looked up, sharded or dynamic."""
    strategy = sharded_strategy(ps_pair)
    async with strategy.scope():
        params = pstrain.Variable(PARAMS, name="params")
        table = pstrain.DynamicEmbedding(2, name="keys")
        opt = pstrain.optimizers.SGD(1.0)
    upstream = np.array([[1.0, 0.0], [5.0, 5.0], [0.0, 2.0]], np.float32)
    pooled, gradient = await embedding_lookup_sparse(params, SP, None, combiner="sum", with_gradient=True)
    np.testing.assert_array_equal(pooled, [[4, 6], [0, 0], [7, 8]])
    grad = gradient(upstream)  # bag 0 is ids 0 and 1; bag 2 is id 3; bag 1 is empty
    assert grad.indices.tolist() == [0, 1, 3]
    np.testing.assert_array_equal(grad.values, [[1, 0], [1, 0], [0, 2]])
    await opt.apply_gradients([(grad, params)])
    np.testing.assert_array_equal(await params.numpy(), PARAMS - [[1, 0], [1, 0], [0, 0], [0, 2]])
    keys = SparseTensor([[0, 0], [0, 1], [2, 0]], [2**40, -3, 2**40], [3, 2])
    before = await table.lookup(np.array([2**40, -3]))
    pooled, gradient = await safe_embedding_lookup_sparse(table, keys, None, "mean", with_gradient=True)
    np.testing.assert_allclose(pooled, [(before[0] + before[1]) / 2, [0, 0], before[0]], rtol=1e-6)
    await opt.apply_gradients([(gradient(upstream), table)])
    after = await table.lookup(np.array([2**40, -3]), training=False)
    np.testing.assert_allclose(after, before - [[0.5, 2.0], [0.5, 0.0]], rtol=1e-6, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="takes the gradient of its output, of shape"):
        gradient(upstream[:2])
    with pytest.raises(InvalidArgumentError, match="one table's rows"):
        await embedding_lookup_sparse([params], SP, None, with_gradient=True)


async def test_lookups_of_no_ids_and_of_matrix_rows_give_tfs_values_and_gradients(ps_server):
    """A batch with no ids at all (TF: an output of no rows, a zero gradient) gives an empty
    gradient that changes nothing; a table whose rows are matrices (TF's ``params`` of rank
    3) gets gradient rows of that shape, and ``max_norm`` clips such a row by its whole
    norm. The first raised a numpy error, the second was refused by the ps, the third
    failed in numpy."""
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        table = pstrain.Variable(PARAMS, name="params")
        cube = pstrain.Variable(np.ones((4, 2, 3), np.float32), name="cube")
        opt = pstrain.optimizers.Adagrad(0.1)
    for ids in (np.zeros(0, np.int64), np.zeros((2, 0), np.int64)):
        rows, gradient = await pstrain.nn.embedding_lookup(table, ids, with_gradient=True)
        assert rows.shape == (*ids.shape, 2)
        grad = gradient(np.ones(rows.shape, np.float32))
        assert grad.values.shape == (0, 2) and grad.indices.size == 0
        await opt.apply_gradients([(grad, table)])
    nothing = SparseTensor(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), dense_shape=[3, 2])
    for combiner in ("sum", "mean", "sqrtn"):
        pooled, gradient = await embedding_lookup_sparse(table, nothing, None, combiner, with_gradient=True)
        assert pooled.shape == (0, 2)  # TF's: no bag is before the last that is not empty
        await opt.apply_gradients([(gradient(np.zeros((0, 2), np.float32)), table)])
    np.testing.assert_array_equal(await table.numpy(), PARAMS)
    rows, gradient = await pstrain.nn.embedding_lookup(cube, np.array([[1, 2]]), with_gradient=True)
    grad = gradient(np.ones(rows.shape, np.float32))
    assert grad.values.shape == (2, 2, 3)
    await opt.apply_gradients([(grad, cube)])
    got = await cube.numpy()
    np.testing.assert_array_equal(got[[0, 3]], np.ones((2, 2, 3)))
    assert np.all(got[1:3] < 1)
    # max_norm clips a matrix row by its whole norm, as TF's (values read off TF 2.21)
    await cube.assign(np.arange(24, dtype=np.float32).reshape(4, 2, 3) / 10)
    lookup = pstrain.nn.embedding_lookup
    rows, gradient = await lookup(cube, np.array([[1, 2]]), max_norm=1.0, with_gradient=True)
    np.testing.assert_allclose(
        rows[0, 0], [[0.282529, 0.329617, 0.376705], [0.423793, 0.470882, 0.517970]], rtol=1e-5
    )
    grad = gradient(np.linspace(-1, 1, 12, dtype=np.float32).reshape(rows.shape))
    assert grad.values.shape == (2, 2, 3) and grad.indices.tolist() == [1, 2]
    np.testing.assert_allclose(
        grad.values[0], [[-0.316547, -0.205210, -0.093873], [0.017465, 0.128802, 0.240139]], atol=1e-5
    )
    rows, gradient = await lookup(table, np.zeros(0, np.int64), max_norm=1.0, with_gradient=True)
    assert gradient(np.zeros(rows.shape, np.float32)).values.shape == (0, 2)


def test_jagged_features_come_from_every_kind_of_input():
    from_sparse = JaggedTensor.from_sparse(SP)
    assert from_sparse.to_lists() == [[0, 1], [], [3], []]
    assert JaggedTensor.from_row_splits([0, 1, 3], [0, 2, 2, 3, 3]) == from_sparse
    assert JaggedTensor.from_lists([[0, 1], [], [3], []]) == from_sparse
    assert JaggedTensor.from_dense(np.array([[1, 2], [3, 4]])).to_lists() == [[1, 2], [3, 4]]
    for shape in ((5, 1), (3, 2), (0, 2), (3, 0)):  # as the same bags given by their lengths
        ids = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
        dense, by_lengths = (
            JaggedTensor.from_dense(ids),
            JaggedTensor(ids.reshape(-1), np.full(shape[0], shape[1])),
        )
        assert dense == by_lengths and dense.width() == by_lengths.width() and dense.offsets.dtype == np.int64
    weighted = JaggedTensor.from_dense(np.array([[1, 2]]), np.array([[2, 3]]))
    assert weighted.weights.dtype == np.float32 and weighted.weights.tolist() == [2.0, 3.0]
    kjt = KeyedJaggedTensor(["a", "b"], [1, 2, 3, 4], lengths=[1, 0, 2, 1], weights=[0.5, 1.0, 1.0, 2.0])
    assert kjt.keys() == ["a", "b"] and kjt.stride() == 2
    assert kjt["a"].to_lists() == [[1], []] and kjt["b"].to_lists() == [[2, 3], [4]]
    assert kjt["b"].weights.tolist() == [1.0, 1.0, 2.0]
    assert kjt.lengths().tolist() == [1, 0, 2, 1] and kjt.values().tolist() == [1, 2, 3, 4]
    taken = kjt.take([1, 1, 0])
    assert taken["b"].to_lists() == [[4], [4], [2, 3]] and taken["a"].to_lists() == [[], [], [1]]
    assert kjt.take([-1])["b"].to_lists() == [[4]]  # from the end, as numpy
    assert kjt.take(np.array([False, True]))["b"].to_lists() == [[4]]  # a mask, as numpy
    for rows, match in (
        ([0.5], "must be integers, got float64"),
        ([True], "boolean mask of"),
        ([2], "range"),
    ):
        with pytest.raises(IndexError, match=match):  # (a float was cut to a row, a mask read as rows)
            kjt.take(np.array(rows))
    for bad, match in (
        (lambda: JaggedTensor([1.5], [1]), "integers"),
        (lambda: JaggedTensor([1, 2], [1]), "hold 1 ids but 2"),
        (lambda: JaggedTensor([1], offsets=[1, 1]), "start at 0"),
        (lambda: KeyedJaggedTensor(["a", "b"], [1], lengths=[1, 0, 0]), "multiple"),
        (lambda: JaggedTensor([1], [1], weights=[1.0, 2.0]), "one per id"),
        # (each was taken: weights as many but misplaced, a float id cut to an integer)
        (
            lambda: JaggedTensor.from_dense(np.ones((2, 3), np.int64), np.ones((3, 2))),
            "weights must have the ids",
        ),
        (lambda: JaggedTensor.from_lists([[1, 2], [3]], [[1.0], [2.0, 3.0]]), "a list per bag, as long as"),
        (lambda: JaggedTensor.from_lists([[1.5]]), "ids must be integers"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            bad()


def test_keyed_jagged_tensors_concat_features_as_torchrecs_and_concat_rows_joins_batches():
    """``KeyedJaggedTensor.concat`` is TorchRec's: the parts' features side by side for the
    same examples (it joined batches, and refused parts of other keys, where a TorchRec user
    groups features); ``concat_rows`` joins batches, as ``pstrain.data`` batches them. A
    weighted batch whose bags are all empty is built (numpy raised). Values as TorchRec
    1.9.2's on the same inputs."""
    a = KeyedJaggedTensor(["a", "b"], [1, 2, 3, 4], lengths=[1, 0, 2, 1], weights=[0.5, 1.0, 1.0, 2.0])
    c = KeyedJaggedTensor(["c"], [7, 8, 9], lengths=[0, 3], weights=[1.0, 2.0, 3.0])
    both = KeyedJaggedTensor.concat([a, c])
    assert both.keys() == ["a", "b", "c"] and both.stride() == 2
    assert both.lengths().tolist() == [1, 0, 2, 1, 0, 3] and both.values().tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert both.weights().tolist() == [0.5, 1.0, 1.0, 2.0, 1.0, 2.0, 3.0]
    assert both.offset_per_key() == [0, 1, 4, 7]
    rows = KeyedJaggedTensor.concat_rows([a, a.take([1])])
    assert rows.keys() == ["a", "b"] and rows.stride() == 3 and rows["b"].to_lists() == [[2, 3], [4], [4]]
    with pytest.raises(InvalidArgumentError, match=r"strides \[2, 1\]"):
        KeyedJaggedTensor.concat([a, c.take([0])])
    with pytest.raises(InvalidArgumentError, match=r"keys \['a', 'b'\] are in more than one part"):
        KeyedJaggedTensor.concat([a, a])
    with pytest.raises(InvalidArgumentError, match="parts with other keys"):
        KeyedJaggedTensor.concat_rows([a, c])
    empty = KeyedJaggedTensor(["a", "b"], np.zeros(0, np.int64), lengths=[0, 0, 0, 0], weights=np.zeros(0))
    assert empty.stride() == 2 and empty["b"].weights.size == 0 and empty.weights().size == 0


def test_datasets_batch_shuffle_and_shard_variable_length_features():
    bags = JaggedTensor.from_lists([[i] * (i % 3) for i in range(10)])
    kjt = KeyedJaggedTensor.from_jt_dict(
        {"x": bags, "y": JaggedTensor.from_dense(np.arange(10).reshape(10, 1))}
    )
    ds = pstrain.data.Dataset.from_tensor_slices((kjt, np.arange(10))).shuffle(10, seed=3).batch(4)
    seen = []
    for features, labels in ds:
        assert features.stride() == labels.size
        for row, label in zip(features["x"].to_lists(), labels):
            assert row == [label] * (label % 3)  # each example's bag stays with its label
        seen += labels.tolist()
    assert sorted(seen) == list(range(10)) and seen != list(range(10))
    shard = list(pstrain.data.Dataset.from_tensor_slices(bags).shard(3, 1).batch(10))
    assert [b.to_lists() for b in shard] == [[[1], [4], [7]]]
    mapped = pstrain.data.Dataset.from_tensor_slices(bags).map(lambda b: b).batch(3)
    assert next(iter(mapped)).to_lists() == [[], [1], [2, 2]]


def test_a_dataset_slices_sparse_and_ragged_features_as_tf_users_build_them():
    """A SparseTensor (TF's feature-column input) or a RaggedTensor-like component slices
    by rows, as ``tf.data`` slices them, and batches as a JaggedTensor beside its labels."""
    sparse = SparseTensor([[0, 0], [0, 1], [2, 0], [3, 0], [3, 1], [3, 2]], [5, 6, 7, 8, 9, 4], [4, 3])
    ragged = SimpleNamespace(values=np.array([5, 6, 7, 8, 9, 4]), row_splits=np.array([0, 2, 2, 3, 6]))
    for features in (sparse, ragged):
        ds = pstrain.data.Dataset.from_tensor_slices((features, np.arange(4))).shard(2, 1).batch(2)
        [(bags, labels)] = list(ds)
        assert bags.to_lists() == [[], [8, 9, 4]] and labels.tolist() == [1, 3]
    with pytest.raises(InvalidArgumentError, match="must be 2-D"):
        pstrain.data.Dataset.from_tensor_slices(SparseTensor([[0, 0, 0]], [1], [1, 1, 1]))


def reference_step(tables, features, configs, d_pooled, lr=0.1, acc0=0.1):
    """Pooled output and Adagrad-updated tables, written out with numpy per example."""
    pooled, grads = [], {name: np.zeros_like(t, np.float64) for name, t in tables.items()}
    column = 0
    for config in configs:
        for f in config.feature_names:
            bags = features[f].to_lists()
            weights = features[f].weights
            out = np.zeros((len(bags), config.embedding_dim))
            k = 0
            for b, bag in enumerate(bags):
                w = np.ones(len(bag)) if weights is None else weights[k : k + len(bag)]
                k += len(bag)
                if config.combiner == "sum":
                    scale = w
                elif config.combiner == "mean":
                    scale = w / (w.sum() or np.inf)
                else:  # sqrtn
                    scale = w / (np.sqrt((w * w).sum()) or np.inf)
                for i, s in zip(bag, scale):
                    out[b] += s * tables[config.name][i]
                    grads[config.name][i] += s * d_pooled[b, column : column + config.embedding_dim]
            pooled.append(out)
            column += config.embedding_dim
    updated = {}
    for name, t in tables.items():
        g = grads[name]
        acc = acc0 + g * g
        touched = np.abs(g).sum(1) > 0
        updated[name] = np.where(touched[:, None], t - lr * g / np.sqrt(acc + 1e-7), t)
    return np.concatenate(pooled, axis=1), updated


async def test_a_collection_reads_and_updates_with_one_request_per_ps(ps_pair):
    configs = [
        TableConfig("big", 1000, 4, ["a", "a_too"]),  # row-sharded, two features
        TableConfig("mean", 50, 2, ["m"], combiner="mean"),
    ]
    configs += [TableConfig(f"t{i}", 20 + i, 3, [f"f{i}"]) for i in range(10)]
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        collection = EmbeddingCollection(configs, shard_rows=100)
        dense = pstrain.Variable(np.ones((4, 2), np.float32), name="dense")
        opt = pstrain.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)
    plan = collection.plan
    assert plan["big"].kind == "row-sharded" and plan["big"].ps == [0, 1]
    assert {plan[f"t{i}"].ps[0] for i in range(10)} == {0, 1}  # the small ones on both ps
    assert "big" in str(plan) and "ps 1:" in str(plan)
    rng = np.random.default_rng(0)
    batch = 5
    features = {
        "a": JaggedTensor.from_lists([[1, 999, 1], [], [500], [0], [999]]),
        "a_too": JaggedTensor.from_lists([[999], [2, 2], [], [1], []]),
        "m": JaggedTensor(rng.integers(0, 50, 9), [2, 0, 3, 1, 3], weights=rng.random(9).astype(np.float32)),
    }
    features.update(
        {
            f"f{i}": JaggedTensor.from_lists(
                [list(rng.integers(0, 20, rng.integers(0, 4))) for _ in range(batch)]
            )
            for i in range(10)
        }
    )
    before = {name: np.asarray(await t.numpy(), np.float64) for name, t in collection.tables.items()}
    with pstrain.count_requests() as reads:
        pooled = await collection.lookup(KeyedJaggedTensor.from_jt_dict(features), read=[dense])
    assert reads.to("ps") == 2 and len(reads.per_task) == 2  # every table and `dense`, each ps once
    d_pooled = rng.standard_normal((batch, collection.output_dim)).astype(np.float32)
    want_pooled, want_tables = reference_step(before, features, configs, d_pooled)
    np.testing.assert_allclose(pooled.concat(), want_pooled, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled.values["m"], want_pooled[:, 8:10], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pooled.read[0], np.ones((4, 2)))
    with pstrain.count_requests() as updates:
        await collection.apply_gradients(
            [*pooled.gradients(d_pooled), (np.zeros((4, 2), np.float32), dense)], opt
        )
    assert updates.to("ps") == 2 and updates.per_op == {"opt/apply": 2}
    for name, t in collection.tables.items():
        np.testing.assert_allclose(await t.numpy(), want_tables[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", ["adam", "schedule"])
async def test_an_optimizer_that_needs_the_step_still_updates_with_one_request_per_ps(ps_pair, kind):
    """Adam's bias correction, or a learning-rate schedule, needs the step before the update:
    it is counted in the request that carries the counter's ps's gradients, and the other
    ps get theirs with it; each step is the one a numpy Adam (Keras') or SGD takes."""
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        collection = EmbeddingCollection(
            [TableConfig("big", 300, 2, ["a"]), TableConfig("small", 9, 2, ["b"])], shard_rows=100
        )
        dense = pstrain.Variable(np.ones(3, np.float32), name="dense")
        if kind == "adam":
            opt = pstrain.optimizers.Adam(0.1)
        else:
            opt = pstrain.optimizers.SGD(pstrain.schedules.ExponentialDecay(0.5, 1, 0.5))
    assert collection.plan["big"].ps == [0, 1]
    want = {name: np.asarray(await t.numpy(), np.float64) for name, t in collection.tables.items()}
    want["dense"] = np.ones(3)
    m = {k: np.zeros_like(v) for k, v in want.items()}
    u = {k: np.zeros_like(v) for k, v in want.items()}
    features = {"a": JaggedTensor.from_lists([[1, 299], [150]]), "b": JaggedTensor.from_lists([[2], [2, 8]])}
    for step in range(1, 4):
        with pstrain.count_requests() as updates:
            pooled = await collection.lookup(features)
            d = np.full((2, 4), 0.5 * step, np.float32)
            grads = [*pooled.gradients(d), (np.full(3, 0.25, np.float32), dense)]
            await collection.apply_gradients(grads, opt)
        assert updates.per_op == {"vars/sparse_read": 2, "opt/apply": 2}, updates.per_op
        assert len(updates.per_task) == 2 and set(updates.per_task.values()) == {2}
        assert int(await opt.iterations.numpy()) == step
        for g, var in grads:
            name = "dense" if var is dense else next(n for n, t in collection.tables.items() if t is var)
            rows = np.asarray(g.indices) if isinstance(g, pstrain.IndexedSlices) else slice(None)
            gv = np.asarray(g.values if isinstance(g, pstrain.IndexedSlices) else g, np.float64)
            if kind == "adam":  # Keras' Adam: the step after the increment
                m[name][rows] = 0.9 * m[name][rows] + 0.1 * gv
                u[name][rows] = 0.999 * u[name][rows] + 0.001 * gv * gv
                lr = 0.1 * np.sqrt(1 - 0.999**step) / (1 - 0.9**step)
                want[name][rows] -= lr * m[name][rows] / (np.sqrt(u[name][rows]) + 1e-7)
            else:  # the schedule read at the step before the increment
                want[name][rows] -= 0.5 * 0.5 ** (step - 1) * gv
        for name, t in collection.tables.items():
            np.testing.assert_allclose(await t.numpy(), want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(await dense.numpy(), want["dense"], rtol=1e-5, atol=1e-6)


async def test_random_collections_pool_and_update_as_written_out_with_numpy(ps_pair):
    """Collections of one to five tables (sizes from 3 rows to past the row-sharding
    threshold, widths, combiners, tables shared by features), batches of bags from empty
    to long with repeated ids and per-id weights: the pooled rows, and the tables after
    one Adagrad step, as ``reference_step`` writes them out per example."""
    rng = np.random.default_rng(11)
    strategy = strategy_for(*ps_pair)
    for case in range(12):
        configs, names = [], []
        for t in range(int(rng.integers(1, 6))):
            rows = int(rng.choice([3, 40, 700]))
            features = [f"c{case}t{t}f{k}" for k in range(int(rng.integers(1, 3)))]
            names += features
            configs.append(
                TableConfig(
                    f"c{case}t{t}",
                    rows,
                    int(rng.choice([2, 5, 8])),
                    features,
                    combiner=str(rng.choice(["sum", "mean", "sqrtn"])),
                )
            )
        async with strategy.scope():
            collection = EmbeddingCollection(configs, shard_rows=500)
            opt = pstrain.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)
        batch = int(rng.integers(1, 40))
        features = {}
        for config in configs:
            for f in config.feature_names:
                lengths = rng.integers(0, 6, batch) * (rng.random(batch) < 0.8)  # some bags empty
                ids = rng.integers(0, config.num_embeddings, int(lengths.sum()))
                weights = rng.random(ids.size).astype(np.float32) + 0.1 if rng.random() < 0.5 else None
                features[f] = JaggedTensor(ids, lengths, weights=weights)
        before = {name: np.asarray(await t.numpy(), np.float64) for name, t in collection.tables.items()}
        pooled = await collection.lookup(KeyedJaggedTensor.from_jt_dict({f: features[f] for f in names}))
        d_pooled = rng.standard_normal((batch, collection.output_dim)).astype(np.float32)
        want_pooled, want_tables = reference_step(before, features, configs, d_pooled)
        what = f"case {case}: {[(c.name, c.num_embeddings, c.embedding_dim, c.combiner) for c in configs]}"
        np.testing.assert_allclose(pooled.concat(), want_pooled, rtol=1e-5, atol=1e-6, err_msg=what)
        await collection.apply_gradients(pooled.gradients(d_pooled), opt)
        for name, t in collection.tables.items():
            np.testing.assert_allclose(
                await t.numpy(), want_tables[name], rtol=1e-5, atol=1e-6, err_msg=f"{what}: {name}"
            )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_embeddings": 0}, "num_embeddings must be a positive integer"),
        ({"embedding_dim": 2.5}, "embedding_dim must be a positive integer"),
        ({"feature_names": "f"}, "feature_names is a list of names"),
        ({"feature_names": []}, "no feature looks it up"),
        ({"feature_names": ["f", "f"]}, "feature_names repeat"),
        ({"feature_names": ["f", 3]}, "feature_names must be non-empty strings"),
        ({"combiner": "max"}, "combiner must be one of"),
        ({"optimizer": "adagrad"}, "optimizer must be a pstrain optimizer"),
        ({"initializer": 0.1}, "initializer must be a pstrain initializer"),
        ({"dtype": np.int32}, "dtype must be a float type"),
        ({"pooling_factor": 0}, "pooling_factor must be positive"),
    ],
)
def test_a_table_config_that_cannot_be_built_is_refused_naming_the_argument(kwargs, message):
    given = {"num_embeddings": 10, "embedding_dim": 4, "feature_names": ["f"]} | kwargs
    with pytest.raises(InvalidArgumentError, match=message):
        TableConfig("t", **given)


async def test_a_collection_refuses_bad_batches_and_changes_nothing(ps_server):
    async with strategy_for(ps_server).scope():
        collection = EmbeddingCollection([TableConfig("t", 10, 2, ["x", "y"])])
    before = await collection.tables["t"].numpy()
    ok = JaggedTensor.from_lists([[1], [2]])
    with pytest.raises(
        InvalidArgumentError,
        match=r"feature 'y': id 10 is out of range \[0, 10\) "
        r"of table 't'",
    ):
        await collection.lookup({"x": ok, "y": JaggedTensor.from_lists([[10], []])})
    with pytest.raises(InvalidArgumentError, match=r"features \['y'\] are missing"):
        await collection.lookup({"x": ok})
    with pytest.raises(InvalidArgumentError, match="different batch sizes"):
        await collection.lookup({"x": ok, "y": JaggedTensor.from_lists([[1]])})
    pooled = await collection.lookup({"x": ok, "y": ok})
    with pytest.raises(InvalidArgumentError, match=r"expected \[2, 4\]"):
        pooled.gradients(np.ones((2, 3)))
    with pytest.raises(InvalidArgumentError, match="no optimizer"):
        await collection.apply_gradients(pooled.gradients(np.ones((2, 4))))
    np.testing.assert_array_equal(await collection.tables["t"].numpy(), before)
    for bad, match in (
        (lambda: TableConfig("t", 0, 2), "num_embeddings"),
        (lambda: TableConfig("t", 5, 2, "x"), "list of names"),
        (lambda: TableConfig("t", 5, 2, combiner="max"), "combiner"),
        (
            lambda: EmbeddingCollection([TableConfig("a", 5, 2, ["x"]), TableConfig("b", 5, 2, ["x"])]),
            "two tables",
        ),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            bad()


async def test_tables_with_their_own_optimizers_and_a_dynamic_table(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        rowwise = pstrain.optimizers.RowWiseAdagrad(0.5, initial_accumulator_value=0.1)
        plain = pstrain.optimizers.SGD(1.0)
        collection = EmbeddingCollection(
            [TableConfig("fixed", 8, 2, ["a"], optimizer=rowwise), TableConfig("dyn", None, 2, ["b"])]
        )
    assert collection.plan["dyn"].kind == "dynamic"
    batch = {"a": JaggedTensor.from_lists([[1, 1], [3]]), "b": JaggedTensor.from_lists([[2**50], [7, 2**50]])}
    fixed0 = await collection.tables["fixed"].numpy()
    dyn0 = await collection.tables["dyn"].lookup(np.array([7, 2**50]))
    pooled = await collection.lookup(batch)
    np.testing.assert_allclose(pooled.values["b"], [dyn0[1], dyn0[0] + dyn0[1]], rtol=1e-6, atol=1e-6)
    d = np.ones((2, 4), np.float32)
    await collection.apply_gradients(pooled.gradients(d), plain)
    # row 1 was looked up twice in one bag: gradient 2 in each column; row 3 once
    fixed = await collection.tables["fixed"].numpy()
    for row, g in ((1, 2.0), (3, 1.0)):
        acc = 0.1 + g * g
        np.testing.assert_allclose(
            fixed[row], fixed0[row] - 0.5 * g / (np.sqrt(acc) + 1e-8), rtol=1e-6, atol=1e-6
        )
    dyn = await collection.tables["dyn"].lookup(np.array([7, 2**50]), training=False)
    np.testing.assert_allclose(dyn, [dyn0[0] - 1.0, dyn0[1] - 2.0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("counters", ["one needs the step", "two need the step"])
async def test_tables_with_their_own_optimizers_update_in_one_request_per_ps(ps_pair, counters):
    """Tables with optimizers of their own (one shared by two tables, a dynamic table's) and
    a dense variable under Adam: one ``opt/apply`` per ps a step carries every optimizer's
    update, and the step is bit for bit what each optimizer's own ``apply_gradients`` gives.
    So do two optimizers that need the step (their counters made on one ps)."""
    zeros = pstrain.initializers.Zeros()

    def make(tag):
        rowwise = pstrain.optimizers.RowWiseAdagrad(0.5, initial_accumulator_value=0.1)
        own = (
            pstrain.optimizers.Adam(0.1) if counters == "two need the step" else pstrain.optimizers.Ftrl(0.1)
        )
        collection = EmbeddingCollection(
            [
                TableConfig(f"{tag}big", 300, 4, ["a"], optimizer=rowwise),
                TableConfig(f"{tag}small", 7, 2, ["b"], combiner="mean", optimizer=rowwise),
                TableConfig(f"{tag}own", 50, 2, ["c"], optimizer=own),
                TableConfig(
                    f"{tag}dyn", None, 2, ["d"], initializer=zeros, optimizer=pstrain.optimizers.Adagrad(0.2)
                ),
            ],
            shard_rows=100,
        )
        dense = pstrain.Variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), name=f"{tag}dense")
        return collection, dense, pstrain.optimizers.Adam(0.05)

    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        together, dense, adam = make("t")
        apart, dense2, adam2 = make("a")
    assert together.plan["tbig"].ps == [0, 1]
    for name, table in together.tables.items():
        if together.plan[name].kind != "dynamic":
            await apart.tables["a" + name[1:]].assign(await table.numpy())
    if counters == "two need the step":  # their counters on one ps: counted in one request
        assert adam.iterations.ps_index == together.configs["town"].optimizer.iterations.ps_index
    rng = np.random.default_rng(3)
    for step in range(1, 4):
        features = {
            "a": JaggedTensor(rng.integers(0, 300, 9), [4, 0, 5]),
            "b": JaggedTensor(rng.integers(0, 7, 4), [1, 2, 1]),
            "c": JaggedTensor(rng.integers(0, 50, 3), [1, 1, 1]),
            "d": JaggedTensor(rng.integers(0, 2**40, 5), [2, 2, 1]),
        }
        d = rng.standard_normal((3, 10)).astype(np.float32)
        g = rng.standard_normal((2, 3)).astype(np.float32)
        pooled = await together.lookup(features)
        with pstrain.count_requests() as updates:
            await together.apply_gradients([*pooled.gradients(d), (g, dense)], adam)
        assert updates.per_op == {"opt/apply": 2} and set(updates.per_task.values()) == {1}, updates.per_task
        pooled2 = await apart.lookup(features)
        groups: dict = {}
        for grad, var in [*pooled2.gradients(d), (g, dense2)]:
            name = next((n for n, t in apart.tables.items() if t is var), None)
            opt = apart.configs[name].optimizer if name is not None else adam2
            groups.setdefault(id(opt), (opt, []))[1].append((grad, var))
        for opt, pairs in groups.values():  # each optimizer's own requests
            await opt.apply_gradients(pairs)
        assert int(await adam.iterations.numpy()) == step
        for name, table in together.tables.items():
            other = apart.tables["a" + name[1:]]
            if together.plan[name].kind == "dynamic":
                ids, rows = await table.export()
                ids2, rows2 = await other.export()
                order, order2 = np.argsort(ids), np.argsort(ids2)
                np.testing.assert_array_equal(ids[order], ids2[order2])
                assert rows[order].tobytes() == rows2[order2].tobytes(), name
            else:
                assert (await table.numpy()).tobytes() == (await other.numpy()).tobytes(), (name, step)
        assert (await dense.numpy()).tobytes() == (await dense2.numpy()).tobytes()


async def test_counting_requests_counts_this_codes_requests_only(ps_server):
    async with strategy_for(ps_server).scope():
        v = pstrain.Variable(np.zeros(3, np.float32), name="v")
    await v.numpy()  # created
    with pstrain.count_requests() as outer:
        await v.numpy()
        with pstrain.count_requests() as inner:
            await v.assign_add(np.ones(3, np.float32))
    await v.numpy()  # after the blocks: not counted
    assert inner.requests == 1 and outer.requests == 2
    assert outer.bytes_sent > inner.bytes_sent > 0 and outer.bytes_received > 0
    assert set(outer.per_op) == {"vars/read", "vars/assign_add"}


async def _train_step(collection, opt, features, d):
    """A collection's step: look the batch up, apply the pooled output's gradient ``d``."""
    pooled = await collection.lookup(features)
    await collection.apply_gradients(pooled.gradients(d), opt)


async def test_a_collection_and_its_row_wise_slots_round_trip_a_checkpoint(ps_pair, tmp_path):
    """Restored into a new collection (a new process's names), the next step is bit for bit the
    step the original takes: tables, row-wise accumulators and the step counter came back."""

    def make():
        collection = EmbeddingCollection(
            [TableConfig("big", 300, 4, ["a"]), TableConfig("small", 7, 2, ["b"], combiner="mean")],
            shard_rows=100,
        )
        return collection, pstrain.optimizers.RowWiseAdagrad(0.3, initial_accumulator_value=0.1)

    rng = np.random.default_rng(4)

    def batch():
        return {
            "a": JaggedTensor(rng.integers(0, 300, 9), [4, 0, 5]),
            "b": JaggedTensor(rng.integers(0, 7, 4), [1, 2, 1]),
        }

    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        collection, opt = make()
    for _ in range(3):
        await _train_step(collection, opt, batch(), rng.standard_normal((3, 6)).astype(np.float32))
    path = await Checkpoint(model=collection, optimizer=opt).save(str(tmp_path / "ckpt"))
    saved = load_variables(path)
    slots = {k: v for k, v in saved.items() if ".OPTIMIZER_SLOT" in k and "accumulator" in k}
    # row-wise: one accumulator per row, not one per number
    assert sorted(v.shape for v in slots.values()) == [(7, 1), (300, 1)], slots.keys()
    async with strategy.scope():
        pstrain.Variable(np.zeros(3, np.float32))  # shifts every generated name
        collection2, opt2 = make()
    status = await Checkpoint(model=collection2, optimizer=opt2).restore(path)
    features, d = batch(), rng.standard_normal((3, 6)).astype(np.float32)
    await _train_step(collection, opt, features, d)
    await _train_step(collection2, opt2, features, d)
    status.assert_consumed()
    for name in ("big", "small"):
        assert (await collection.tables[name].numpy()).tobytes() == (
            await collection2.tables[name].numpy()
        ).tobytes(), name
    assert int(await opt2.iterations.numpy()) == 4


async def test_tables_with_their_own_optimizers_round_trip_a_checkpoint_of_the_collection(ps_pair, tmp_path):
    """A collection whose tables name their own optimizers (one shared by two tables, one
    table's alone, a dynamic table's) is saved with their slots and step counts: restored
    into a new collection, the next step is bit for bit the original's."""

    def make():
        shared = pstrain.optimizers.Adam(0.01)
        collection = EmbeddingCollection(
            [
                TableConfig("big", 300, 4, ["a"], optimizer=shared),
                TableConfig("small", 7, 2, ["b"], combiner="mean", optimizer=shared),
                TableConfig("own", 50, 2, ["c"], optimizer=pstrain.optimizers.Ftrl(0.1)),
                TableConfig("dyn", None, 2, ["d"], optimizer=pstrain.optimizers.RowWiseAdagrad(0.2)),
            ],
            shard_rows=100,
        )
        return collection, pstrain.optimizers.SGD(0.1)  # (no table is left to it)

    rng = np.random.default_rng(5)

    def batch():
        return {
            "a": JaggedTensor(rng.integers(0, 300, 9), [4, 0, 5]),
            "b": JaggedTensor(rng.integers(0, 7, 4), [1, 2, 1]),
            "c": JaggedTensor(rng.integers(0, 50, 3), [1, 1, 1]),
            "d": JaggedTensor(rng.integers(0, 2**40, 5), [2, 2, 1]),
        }

    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        collection, opt = make()
    for _ in range(3):
        await _train_step(collection, opt, batch(), rng.standard_normal((3, 10)).astype(np.float32))
    path = await Checkpoint(model=collection).save(str(tmp_path / "ckpt"))
    saved = load_variables(path)
    assert int(saved["model/optimizers/big/iterations"]) == 3  # Adam's, shared: one count
    assert "model/optimizers/small/iterations" not in saved
    assert any(k.startswith("model/tables/dyn/slot:") for k in saved), sorted(saved)
    async with strategy.scope():
        pstrain.Variable(np.zeros(3, np.float32))  # shifts every generated name
        collection2, opt2 = make()
    status = await Checkpoint(model=collection2).restore(path)
    features, d = batch(), rng.standard_normal((3, 10)).astype(np.float32)
    await _train_step(collection, opt, features, d)
    await _train_step(collection2, opt2, features, d)
    status.assert_consumed()
    for name in ("big", "small", "own"):
        assert (await collection.tables[name].numpy()).tobytes() == (
            await collection2.tables[name].numpy()
        ).tobytes(), name
    ids, rows = await collection.tables["dyn"].export()
    ids2, rows2 = await collection2.tables["dyn"].export()
    np.testing.assert_array_equal(ids, ids2)
    assert rows.tobytes() == rows2.tobytes()


async def test_dynamic_and_fixed_tables_are_read_in_one_request_per_ps(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        collection = EmbeddingCollection(
            [TableConfig(f"d{i}", None, 2, [f"f{i}"], combiner="mean") for i in range(4)]
            + [TableConfig("fixed", 10, 2, ["x"])]
        )
        opt = pstrain.optimizers.SGD(1.0)
        dense = [pstrain.Variable(np.full((2, 3), float(k), np.float32), name=f"w{k}") for k in range(3)]
    rng = np.random.default_rng(5)
    batch = {f"f{i}": JaggedTensor(rng.integers(-(2**62), 2**62, 6), [2, 3, 1]) for i in range(4)}
    batch["x"] = JaggedTensor.from_lists([[1], [2, 3], []])
    expected = {}
    for i in range(4):  # each table's own lookups, as a reference (admits the ids first)
        rows = await collection.tables[f"d{i}"].lookup(batch[f"f{i}"].values)
        expected[f"f{i}"] = np.stack([rows[0:2].mean(0), rows[2:5].mean(0), rows[5]])
    fixed = await collection.tables["fixed"].numpy()
    with pstrain.count_requests() as reads:
        pooled = await collection.lookup(batch, read=dense)
    # the fixed table's rows and the dense variables go in the requests of the dynamic tables
    assert reads.per_op == {"dyn/lookup_many": 2}, reads.per_op
    assert [v.tolist() for v in pooled.read] == [np.full((2, 3), float(k)).tolist() for k in range(3)]
    np.testing.assert_allclose(
        pooled.values["x"], [fixed[1], fixed[2] + fixed[3], [0, 0]], rtol=1e-6, atol=1e-6
    )
    for f, want in expected.items():
        np.testing.assert_allclose(pooled.values[f], want, rtol=1e-6, atol=1e-6)
    with pstrain.count_requests() as updates:
        await collection.apply_gradients(pooled.gradients(np.ones((3, 10), np.float32)), opt)
    assert updates.to("ps") == 2
    peers = pstrain.rpc.ChannelPool(strategy.cluster_spec, cluster.token)
    try:  # on the wire: a table named twice, or an id twice, is refused whole
        key = collection.tables["d0"].key
        for lookups, match in (
            (
                [{"name": key, "ids": np.array([1])}, {"name": key, "ids": np.array([2])}],
                "named more than once",
            ),
            ([{"name": key, "ids": np.array([3, 3])}], "distinct"),
        ):
            with pytest.raises(InvalidArgumentError, match=match):
                await untyped_call(peers.channel("ps", 0), "dyn/lookup_many", {"lookups": lookups})
    finally:
        await peers.close()


async def test_a_table_with_row_wise_slots_moves_to_another_ps_and_trains_on(cluster):
    """A move carries the table's part and its one-column accumulator; the next step there is
    the step the table would have taken where it was."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        collection = EmbeddingCollection([TableConfig("t", 40, 4, ["x"])])
        opt = pstrain.optimizers.RowWiseAdagrad(0.2, initial_accumulator_value=0.1)
    table = collection.tables["t"]
    batch = {"x": JaggedTensor.from_lists([[1, 2, 2], [39]])}
    d = np.ones((2, 4), np.float32)
    for _ in range(2):
        pooled = await collection.lookup(batch)
        await collection.apply_gradients(pooled.gradients(d), opt)
    before = await table.numpy()
    home, other = table.ps_index, 1 - table.ps_index
    slot = opt.slot_variable_name(table, "accumulator")
    assert cluster.ps[home].store.get(slot).array.shape == (40, 1)
    await coordinator.ps.move([table.key], other)
    assert cluster.ps[other].store.get(slot).array.shape == (40, 1)
    pooled = await collection.lookup(batch)
    await collection.apply_gradients(pooled.gradients(d), opt)
    # the third step of rows 1, 39 (g = 1 in each column) and 2 (g = 2): acc = 0.1 + 3 g²
    after = await table.numpy()
    for row, g in ((1, 1.0), (2, 2.0), (39, 1.0)):
        acc = 0.1 + 3 * g * g
        np.testing.assert_allclose(
            after[row], before[row] - 0.2 * g / (np.sqrt(acc) + 1e-8), rtol=1e-5, atol=1e-6
        )
    await coordinator.close()


async def test_a_collection_outside_a_strategy_pools_its_local_tables():
    collection = EmbeddingCollection([TableConfig("t", 6, 2, ["x", "y"], combiner="sqrtn")])
    table = await collection.tables["t"].numpy()
    w = pstrain.Variable(np.arange(4.0).reshape(2, 2), name="w")
    pooled = await collection.lookup(
        {"x": JaggedTensor.from_lists([[0, 5], []]), "y": JaggedTensor.from_lists([[3], [3, 3]])}, read=[w]
    )
    np.testing.assert_allclose(
        pooled.values["x"], [(table[0] + table[5]) / np.sqrt(2), [0, 0]], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(
        pooled.values["y"], [table[3], 2 * table[3] / np.sqrt(2)], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(pooled.read[0], [[0, 1], [2, 3]])
    ((grad, _),) = pooled.gradients(np.ones((2, 4), np.float32))
    assert grad.indices.tolist() == [0, 3, 5]
    with pytest.raises(InvalidArgumentError, match="lives on the ps"):
        EmbeddingCollection([TableConfig("dyn", None, 2)])


async def test_a_bad_multi_table_lookup_is_refused_whole_and_admits_nothing(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(2, name="t")
        v = pstrain.Variable(np.zeros((3, 2), np.float32), name="v")
    await table.lookup(np.array([1, 2]))
    await v.numpy()
    holder = v.ps_index  # a new id of the table's shard there
    new_id = next(i for i in range(3, 1000) if int(table.route(np.array([i]))[0][0]) == holder)
    peers = pstrain.rpc.ChannelPool(strategy.cluster_spec, cluster.token)
    try:
        ok = {"name": table.key, "ids": np.array([new_id])}
        for payload, error, match in (
            ({"lookups": []}, InvalidArgumentError, "length >= 1"),
            ({"lookups": [{"name": "nope", "ids": np.array([1])}]}, NotFoundError, "'nope' not found"),
            (
                {"lookups": [ok], "reads": [{"name": "v"}, {"name": "v"}]},
                InvalidArgumentError,
                "read whole more than once",
            ),
            (
                {"lookups": [ok], "reads": [{"name": "v", "indices": np.array([9])}]},
                InvalidArgumentError,
                "out of range",
            ),
            ({"lookups": [{"name": table.key, "ids": np.array([1.5])}]}, InvalidArgumentError, "integer"),
        ):
            with pytest.raises(error, match=match):
                await untyped_call(peers.channel("ps", holder), "dyn/lookup_many", payload)
    finally:
        await peers.close()
    assert (await table.statistics())["rows"] == 2  # the new id was never admitted
