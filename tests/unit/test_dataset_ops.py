"""``pstrain.data.Dataset``'s transformations as ``tf.data`` defines them: random pipelines
of them against the same steps on a Python list (from ``from_tensor_slices``, whose first
steps move row indices, and from a generator, element by element), and TF's rules for
``skip``, ``filter``, ``enumerate``, ``zip``, ``concatenate``, ``unbatch``, ``flat_map`` and
``cache``, with clear refusals of what TF refuses."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pstrain import JaggedTensor, KeyedJaggedTensor
from pstrain._embeddings.jagged import ExampleMajorBags
from pstrain.data import Dataset, Options, TensorSpec
from pstrain.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)


def _reference(elems: list, op: tuple) -> list:
    """``op`` on a list of elements (ints, or tuples of ints for a batch)."""
    kind, *args = op
    if kind == "shard":
        return elems[args[1] :: args[0]]
    if kind == "take":
        return elems if args[0] < 0 else elems[: args[0]]
    if kind == "skip":
        return [] if args[0] < 0 else elems[args[0] :]
    if kind == "repeat":
        return elems * args[0]
    if kind == "filter":
        return [e for e in elems if e % args[0] == 0]
    if kind == "batch_unbatch":
        size, drop = args
        kept = len(elems) - len(elems) % size if drop else len(elems)
        return elems[:kept]
    if kind == "concatenate_self":
        return elems + elems
    return elems  # map, prefetch, cache: the same elements


def _apply(ds: Dataset, op: tuple) -> Dataset:
    kind, *args = op
    if kind == "shard":
        return ds.shard(*args)
    if kind == "take":
        return ds.take(args[0])
    if kind == "skip":
        return ds.skip(args[0])
    if kind == "repeat":
        return ds.repeat(args[0])
    if kind == "filter":
        return ds.filter(lambda a, _: a % args[0] == 0)
    if kind == "batch_unbatch":
        return ds.batch(args[0], drop_remainder=args[1]).unbatch()
    if kind == "concatenate_self":
        return ds.concatenate(ds)
    if kind == "map":
        return ds.map(lambda a, j: (a, j))
    if kind == "prefetch":
        return ds.prefetch(args[0])
    return ds.cache()


def _random_op(rng: random.Random) -> tuple:
    kind = rng.choice(
        [
            "shard",
            "take",
            "skip",
            "repeat",
            "filter",
            "batch_unbatch",
            "concatenate_self",
            "map",
            "prefetch",
            "cache",
        ]
    )
    if kind == "shard":
        n = rng.randrange(1, 4)
        return ("shard", n, rng.randrange(n))
    if kind in ("take", "skip"):
        return (kind, rng.randrange(-1, 12))
    if kind == "repeat":
        return ("repeat", rng.randrange(0, 3))
    if kind == "filter":
        return ("filter", rng.randrange(1, 4))
    if kind == "batch_unbatch":
        return ("batch_unbatch", rng.randrange(1, 5), rng.random() < 0.5)
    if kind == "prefetch":
        return ("prefetch", rng.randrange(1, 3))
    return (kind,)


@pytest.mark.parametrize("features", ["jagged", "keyed"])
@pytest.mark.parametrize("source", ["slices", "generator"])
def test_random_pipelines_give_what_the_same_steps_give_on_a_list(source, features):
    """Each example is a number and a bag of ids (``JaggedTensor``), or two features of bags
    (a ``KeyedJaggedTensor``, which ``from_tensor_slices`` keeps example by example: one of
    bags, one single-hot and weighted); every pipeline's elements are the reference's, each
    with its own bags, iterated twice."""
    for seed in range(150):
        rng = random.Random(seed)
        n = rng.randrange(0, 25)
        lengths = np.array([rng.randrange(0, 4) for _ in range(n)], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = np.arange(int(lengths.sum()), dtype=np.int64) * 10
        bags = JaggedTensor(values, lengths)
        if features == "keyed":
            one = JaggedTensor.from_dense(
                np.arange(n).reshape(n, 1) * 3, weights=np.arange(n).reshape(n, 1) / 2
            )
            bags = KeyedJaggedTensor.from_jt_dict({"ids": bags, "one": one})
        if source == "slices":
            ds = Dataset.from_tensor_slices((np.arange(n, dtype=np.int64), bags))
        else:
            ds = Dataset.from_generator(
                lambda n=n, bags=bags: ((np.int64(i), bags.take(np.array([i]))) for i in range(n))
            )
        ops = [_random_op(rng) for _ in range(rng.randrange(1, 5))]
        want = list(range(n))
        for op in ops:
            ds, want = _apply(ds, op), _reference(want, op)
        for _ in range(2):
            got = list(ds)
            assert [int(a) for a, _ in got] == want, (seed, ops)
            for a, bag in got:
                ids = bag["ids"] if features == "keyed" else bag
                np.testing.assert_array_equal(ids.values, values[offsets[int(a)] : offsets[int(a) + 1]])
                if features == "keyed":
                    assert bag["one"].values.tolist() == [3 * int(a)] and bag["one"].width() == 1
                    assert bag["one"].weights.tolist() == [int(a) / 2] and bag["ids"].weights is None


def test_a_shuffled_dataset_of_keyed_features_batches_what_the_features_own_take_gives():
    """``from_tensor_slices`` keeps a KeyedJaggedTensor's examples side by side (one run of
    memory an example, for batches drawn at random); its batches are what the features' own
    ``take`` gives for the same examples: ids of every dtype, weights where a feature has
    them, single-hot widths, bags longer than a short copy. Features whose ids differ in
    dtype are kept as given, and batch as well."""
    rng = np.random.default_rng(4)
    n = 300
    for dtype in (np.int32, np.int64, np.uint16):
        lengths = rng.integers(0, 25, n)
        feats = {
            "bags": JaggedTensor(rng.integers(0, 1000, lengths.sum()).astype(dtype), lengths),
            "one": JaggedTensor.from_dense(rng.integers(0, 9, (n, 1)).astype(dtype)),
            "weighted": JaggedTensor(
                rng.integers(0, 50, 2 * n).astype(dtype), np.full(n, 2), weights=rng.random(2 * n)
            ),
        }
        kjt = KeyedJaggedTensor.from_jt_dict(feats)
        assert isinstance(ExampleMajorBags.of(kjt), ExampleMajorBags)
        order = np.concatenate(list(Dataset.from_tensor_slices(np.arange(n)).shuffle(n, seed=9).batch(64)))
        batches = list(Dataset.from_tensor_slices(kjt).shuffle(n, seed=9).batch(64))
        assert sum(b.stride() for b in batches) == n
        at = 0
        for batch in batches:
            want = kjt.take(order[at : at + batch.stride()])
            at += batch.stride()
            assert batch.keys() == want.keys()
            for key in want.keys():
                assert batch[key] == want[key] and batch[key].values.dtype == np.dtype(dtype)
            assert batch["one"].width() == 1 and batch["bags"].weights is None
    mixed = KeyedJaggedTensor.from_jt_dict(
        {"a": JaggedTensor(np.arange(4, dtype=np.int32), [1, 3]), "b": JaggedTensor(np.arange(2), [2, 0])}
    )
    assert ExampleMajorBags.of(mixed) is mixed
    (batch,) = Dataset.from_tensor_slices(mixed).batch(2)
    assert batch["a"] == mixed["a"] and batch["b"] == mixed["b"]
    with pytest.raises(IndexError, match="KeyedJaggedTensor: row index out of range"):  # as its own take
        ExampleMajorBags.of(kjt).take([n])


def test_skip_takes_minus_one_for_everything_and_refuses_less():
    ds = Dataset.range(5)
    assert [int(x) for x in ds.skip(3)] == [3, 4]
    assert list(ds.skip(-1)) == [] and [int(x) for x in ds.skip(0)] == [0, 1, 2, 3, 4]
    assert [int(x) for x in Dataset.from_tensor_slices(np.arange(9000)).skip(8997)] == [8997, 8998, 8999]
    with pytest.raises(InvalidArgumentError, match="skip count"):
        ds.skip(-2)


def test_filter_keeps_what_a_scalar_bool_predicate_keeps():
    ds = Dataset.from_tensor_slices((np.arange(6), np.arange(6) * 10))
    assert [(int(a), int(b)) for a, b in ds.filter(lambda a, b: b > 25)] == [(3, 30), (4, 40), (5, 50)]
    with pytest.raises(InvalidArgumentError, match="scalar bool"):
        list(ds.filter(lambda a, b: np.array([True, False])))
    with pytest.raises(InvalidArgumentError, match="scalar bool"):
        list(ds.filter(lambda a, b: 1))
    with pytest.raises(InvalidArgumentError, match="filter takes a function"):
        ds.filter(None)


def test_enumerate_zip_and_concatenate():
    a, b = Dataset.range(3), Dataset.from_tensor_slices(np.array([7.0, 8.0]))
    assert [(int(i), int(x)) for i, x in a.enumerate(start=10)] == [(10, 0), (11, 1), (12, 2)]
    assert [(int(x), float(y)) for x, y in Dataset.zip((a, b))] == [(0, 7.0), (1, 8.0)]
    assert [(int(x), float(y)) for x, y in Dataset.zip(a, b)] == [(0, 7.0), (1, 8.0)]
    assert [{k: float(v) for k, v in d.items()} for d in Dataset.zip({"x": a, "y": b})] == [
        {"x": 0.0, "y": 7.0},
        {"x": 1.0, "y": 8.0},
    ]
    assert [int(x) for x in a.concatenate(Dataset.range(5, 7))] == [0, 1, 2, 5, 6]
    with pytest.raises(InvalidArgumentError, match="not of the first's structure"):
        list(a.concatenate(b))
    with pytest.raises(InvalidArgumentError, match="Dataset.zip takes Datasets"):
        Dataset.zip((a, [1, 2]))
    with pytest.raises(InvalidArgumentError, match="at least one Dataset"):
        Dataset.zip(())
    # nested structures, and a dataset alone, as TF 2.21's
    c = Dataset.range(20, 22)
    nested = [(int(x), (float(y), int(z))) for x, (y, z) in Dataset.zip((a, (b, c)))]
    assert nested == [(0, (7.0, 20)), (1, (8.0, 21))]
    assert Dataset.zip({"x": a, "y": (b, {"z": c})}).cardinality() == 2
    (first, _) = Dataset.zip({"x": a, "y": (b, {"z": c})})
    assert int(first["x"]) == 0 and float(first["y"][0]) == 7.0 and int(first["y"][1]["z"]) == 20
    assert [int(x) for x in Dataset.zip(a)] == [int(x) for x in a]
    with pytest.raises(InvalidArgumentError, match="concatenate takes a Dataset"):
        a.concatenate([1])


def test_unbatch_splits_arrays_tuples_dicts_and_bags_by_their_first_dimension():
    bags = JaggedTensor(np.arange(6), np.array([1, 2, 0, 3]))
    rows = Dataset.from_tensor_slices({"x": np.arange(8).reshape(4, 2), "ids": bags}).batch(3).unbatch()
    got = list(rows)
    assert [r["x"].tolist() for r in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r["ids"].values.tolist() for r in got] == [[0], [1, 2], [], [3, 4, 5]]
    with pytest.raises(InvalidArgumentError, match="unbatch: an element has no first dimension"):
        list(Dataset.range(2).unbatch())
    uneven = Dataset.from_generator(lambda: iter([(np.zeros(2), np.zeros(3))]))
    with pytest.raises(InvalidArgumentError, match="unbatch: components have different lengths"):
        list(uneven.unbatch())


def test_cache_runs_the_pipeline_before_it_once_and_only_a_whole_pass_counts():
    calls = []
    ds = Dataset.range(4).map(lambda x: calls.append(int(x)) or x * 2).cache()
    assert [int(x) for x in ds.take(2)] == [0, 2]  # a partial pass: nothing cached
    assert [int(x) for x in ds] == [0, 2, 4, 6]
    assert [int(x) for x in ds] == [0, 2, 4, 6] and calls == [0, 1, 0, 1, 2, 3]
    with pytest.raises(InvalidArgumentError, match="a cache on disk is not supported"):
        Dataset.range(2).cache("/tmp/cache")


def test_flat_map_apply_and_as_numpy_iterator():
    ds = Dataset.range(1, 4).flat_map(lambda n: Dataset.range(int(n)))
    assert [int(x) for x in ds] == [0, 0, 1, 0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="must return a Dataset"):
        list(Dataset.range(2).flat_map(lambda n: [n]))
    assert [int(x) for x in Dataset.range(5).apply(lambda d: d.skip(3))] == [3, 4]
    assert [int(x) for x in Dataset.range(2).as_numpy_iterator()] == [0, 1]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Dataset.from_tensor_slices(5), "no first dimension to slice"),
        (
            lambda: Dataset.from_tensor_slices([[1, 2], [3]]),
            "rows differ in length; give it as a pstrain.JaggedTensor",
        ),
        (lambda: Dataset.range(3).map("f"), "map takes a function"),
        (lambda: Dataset.range(3).shuffle(2.5), "shuffle buffer_size must be a whole number"),
        (lambda: Dataset.range(3).apply(lambda d: 3), "apply: the function must return a Dataset"),
    ],
)
def test_what_tf_refuses_is_refused_when_the_pipeline_is_built(build, message):
    with pytest.raises(InvalidArgumentError, match=message):
        build()


def test_map_and_batch_take_tfs_parallel_call_arguments_and_keep_the_order():
    from pstrain.data import AUTOTUNE

    ds = Dataset.range(7).map(
        lambda x: x * 3, num_parallel_calls=AUTOTUNE, deterministic=False, name="triple"
    )
    batches = ds.batch(3, num_parallel_calls=2, deterministic=True)
    assert [b.tolist() for b in batches] == [[0, 3, 6], [9, 12, 15], [18]]
    with pytest.raises(InvalidArgumentError, match="num_parallel_calls must be AUTOTUNE"):
        Dataset.range(2).map(lambda x: x, num_parallel_calls=0)
    with pytest.raises(InvalidArgumentError, match="batch num_parallel_calls"):
        Dataset.range(2).batch(2, num_parallel_calls="many")


def test_cardinality_follows_tfs_rules_and_len_refuses_what_it_cannot_know():
    from pstrain.data import INFINITE_CARDINALITY, UNKNOWN_CARDINALITY

    ds = Dataset.from_tensor_slices(np.arange(10))
    gen = Dataset.from_generator(lambda: iter(range(3)))
    cases = [
        (ds, 10),
        (ds.shard(3, 1), 3),
        (ds.batch(3), 4),
        (ds.batch(3, drop_remainder=True), 3),
        (ds.repeat(2), 20),
        (ds.repeat(), INFINITE_CARDINALITY),
        (ds.take(0).repeat(), 0),
        (ds.repeat().take(5), 5),
        (ds.take(40), 10),
        (ds.skip(4), 6),
        (ds.skip(-1), 0),
        (ds.shuffle(4).map(lambda x: x).prefetch(1).cache().enumerate(), 10),
        (ds.filter(lambda x: True), UNKNOWN_CARDINALITY),
        (gen, UNKNOWN_CARDINALITY),
        (gen.repeat(), INFINITE_CARDINALITY),
        (ds.concatenate(Dataset.range(3)), 13),
        (ds.concatenate(ds.repeat()), INFINITE_CARDINALITY),
        (Dataset.zip(ds, Dataset.range(4)), 4),
        (Dataset.zip(ds.repeat(), Dataset.range(4)), 4),
        (Dataset.zip(ds, gen), UNKNOWN_CARDINALITY),
        (ds.flat_map(lambda x: Dataset.range(2)), UNKNOWN_CARDINALITY),
        (ds.batch(2).unbatch(), UNKNOWN_CARDINALITY),
        # unbatch knows its count when every batch's size is known (TF 2.21's on the same)
        (ds.batch(3, drop_remainder=True).unbatch(), 9),
        (ds.batch(3, drop_remainder=True).shuffle(3).take(2).cache().prefetch(1).unbatch(), 6),
        (
            ds.batch(3, drop_remainder=True)
            .concatenate(Dataset.range(4).batch(3, drop_remainder=True))
            .unbatch(),
            12,
        ),
        (Dataset.from_tensor_slices(np.zeros((4, 3, 2))).unbatch(), 12),
        (Dataset.from_tensors(np.zeros((5, 2))).unbatch(), 5),
        (ds.batch(2).repeat().unbatch(), INFINITE_CARDINALITY),
        (ds.batch(3, drop_remainder=True).map(lambda x: x).unbatch(), UNKNOWN_CARDINALITY),
        (ds.batch(4, drop_remainder=True).rebatch(2, drop_remainder=True), UNKNOWN_CARDINALITY),
    ]
    for dataset, want in cases:
        assert dataset.cardinality() == want
        if want >= 0:
            assert len(dataset) == want == len(list(dataset))
    with pytest.raises(TypeError, match="infinite"):
        len(ds.repeat())
    with pytest.raises(TypeError, match="unknown"):
        len(gen)
    assert bool(gen) and list(gen) == [0, 1, 2]


def test_padded_batch_pads_each_component_as_tf_does():
    """TF's documented examples: to the longest in the batch, or to a padded shape, with a
    padding value per component."""
    a = Dataset.range(1, 5).map(lambda x: np.full(int(x), x))
    assert [b.tolist() for b in a.padded_batch(2)] == [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]]]
    assert [b.tolist() for b in a.padded_batch(2, padded_shapes=5)] == [
        [[1, 0, 0, 0, 0], [2, 2, 0, 0, 0]],
        [[3, 3, 3, 0, 0], [4, 4, 4, 4, 0]],
    ]
    assert [
        b.tolist() for b in a.padded_batch(3, padded_shapes=[None], padding_values=-1, drop_remainder=True)
    ] == [[[1, -1, -1], [2, 2, -1], [3, 3, 3]]]
    pairs = Dataset.zip({"x": a, "w": a.map(lambda x: x.astype(np.float32) / 2)})
    first = next(
        iter(pairs.padded_batch(2, padded_shapes={"x": [3], "w": [None]}, padding_values={"w": 9.0}))
    )
    assert first["x"].tolist() == [[1, 0, 0], [2, 2, 0]] and first["w"].tolist() == [[0.5, 9.0], [1.0, 1.0]]
    assert a.padded_batch(3).cardinality() == 2
    with pytest.raises(InvalidArgumentError, match="past its padded shape"):
        list(a.padded_batch(2, padded_shapes=[1]))
    bags = Dataset.from_tensor_slices(JaggedTensor(np.arange(3), np.array([1, 2])))
    with pytest.raises(InvalidArgumentError, match="bags of ids .* batch as they are with batch"):
        list(bags.padded_batch(2))


def test_ragged_batch_batches_ids_of_any_length_as_bags():
    """TF's documented example (``range(6).map(range).ragged_batch(2)``); with a declared
    signature, the components of shape (None,) become bags and fixed ones stack, as TF
    decides by the static shape; other elements that differ are refused by component."""
    ranges = Dataset.range(6).map(lambda x: np.arange(int(x)))
    got = list(ranges.ragged_batch(2))
    assert all(isinstance(b, JaggedTensor) for b in got)
    assert [b.to_lists() for b in got] == [[[], [0]], [[0, 1], [0, 1, 2]], [[0, 1, 2, 3], [0, 1, 2, 3, 4]]]
    assert [len(b) for b in ranges.ragged_batch(4, drop_remainder=True)] == [4]

    def examples():
        for n in (2, 0, 3):
            yield {"ids": np.arange(n, dtype=np.int64), "pos": np.full(3, n, np.int64), "y": np.float32(n)}

    signature = {
        "ids": TensorSpec((None,), np.int64),
        "pos": TensorSpec((3,), np.int64),
        "y": TensorSpec((), np.float32),
    }
    (batch,) = Dataset.from_generator(examples, output_signature=signature).ragged_batch(3)
    assert batch["ids"].to_lists() == [[0, 1], [], [0, 1, 2]]
    assert batch["pos"].tolist() == [[2, 2, 2], [0, 0, 0], [3, 3, 3]] and batch["y"].tolist() == [2, 0, 3]
    mixed = Dataset.zip((ranges, ranges.map(lambda r: r.astype(np.float32))))
    with pytest.raises(InvalidArgumentError, match=r"ragged_batch: component\[1\]'s elements have shapes"):
        list(mixed.ragged_batch(2))
    declared = Dataset.from_generator(
        lambda: iter([np.zeros(2, np.float32)]), output_signature=TensorSpec((None,), np.float32)
    )
    with pytest.raises(InvalidArgumentError, match="holds ids of variable length, but an element is float32"):
        list(declared.ragged_batch(2))


def test_ignore_errors_drops_the_elements_a_map_or_filter_raised_on(caplog):
    """TF's documented example (``1 / x`` of [1, 2, 0, 4] gives [1, 0.5, 0.25]), through
    map and filter steps after from_tensor_slices and a generator; the dataset without it
    still raises, another step before it is refused by name, and a predicate that returns no
    bool is still an error."""

    def inverse(x):
        if x == 0:
            raise ZeroDivisionError("1 / 0")
        return np.float32(1 / x)

    ds = Dataset.from_tensor_slices(np.array([1, 2, 0, 4], np.float32)).map(inverse)
    with caplog.at_level("WARNING", logger="pstrain.data"):
        assert [float(x) for x in ds.ignore_errors(log_warning=True)] == [1.0, 0.5, 0.25]
    assert "dropped an element: ZeroDivisionError: 1 / 0" in caplog.text
    assert ds.ignore_errors().cardinality() == -2  # (TF's: unknown)
    with pytest.raises(ZeroDivisionError):
        list(ds)
    chained = (
        Dataset.from_generator(lambda: iter(range(6)), output_signature=TensorSpec((), np.int64))
        .map(lambda x: (x, x - 3))
        .filter(lambda x, d: 6 // int(d) > -10)  # raises at 3
        .map(lambda x, d: int(x) * 10 // (int(x) - 1))  # raises at 1
    )
    assert [int(x) for x in chained.ignore_errors()] == [0, 20, 13, 12]
    with pytest.raises(InvalidArgumentError, match="does not end in a map or filter"):
        ds.batch(2).ignore_errors()
    with pytest.raises(InvalidArgumentError, match="must return a scalar bool"):
        list(Dataset.range(3).filter(lambda x: 1).ignore_errors())


def test_random_gives_tfs_numbers_and_repeats_them_as_tf_does():
    """``Dataset.random``: int64 scalars from 0 below 2**32 without end; the same numbers
    on every iteration (seeded, or from the seed drawn when the dataset was made) unless
    ``rerandomize_each_iteration``, as TensorFlow 2.21's."""
    many = np.array(list(Dataset.random(seed=1).take(20_000)))
    assert many.dtype == np.int64 and many.min() >= 0 and many.max() < 2**32
    assert 0.45 < float((many >= 2**31).mean()) < 0.55  # the top bit as often set as not
    assert Dataset.random(seed=1).cardinality() == -1
    seeded, again = Dataset.random(seed=4).take(5), Dataset.random(seed=4).take(5)
    assert list(seeded) == list(seeded) == list(again)
    drawn = Dataset.random().take(5)
    assert list(drawn) == list(drawn) and list(drawn) != list(Dataset.random().take(5))
    fresh = Dataset.random(seed=4, rerandomize_each_iteration=True).take(5)
    first, second = list(fresh), list(fresh)
    assert first == list(seeded) and second != first
    again = Dataset.random(seed=4, rerandomize_each_iteration=True).take(5)
    assert [list(again), list(again)] == [first, second]  # reproducible from the seed
    with pytest.raises(InvalidArgumentError, match="random: seed must be a whole number"):
        Dataset.random(seed=1.5)


def test_sparse_batch_gives_tfs_sparse_tensors_and_refuses_what_tf_refuses():
    """``sparse_batch(n, row_shape)``: every entry of each element at ``[i, *its index]``,
    ``dense_shape`` the row shape (None: the batch's largest), scalars too; values read off
    TensorFlow 2.21 on the same elements. A larger element, another rank, a tuple element
    and a bad row shape are refused by name."""
    bags = Dataset.from_generator(
        lambda: iter([np.array([1, 2]), np.array([3]), np.zeros(0, np.int64), np.array([4, 5, 6])]),
        output_signature=TensorSpec((None,), np.int64),
    )
    got = [(b.indices.tolist(), b.values.tolist(), b.dense_shape.tolist()) for b in bags.sparse_batch(3, [5])]
    assert got == [
        ([[0, 0], [0, 1], [1, 0]], [1, 2, 3], [3, 5]),
        ([[0, 0], [0, 1], [0, 2]], [4, 5, 6], [1, 5]),
    ]
    assert [b.dense_shape.tolist() for b in bags.sparse_batch(3, [None])] == [[3, 2], [1, 3]]
    rows = Dataset.from_generator(
        lambda: iter([np.array([[1, 2]]), np.array([[3, 0], [4, 0]])]),
        output_signature=TensorSpec((None, 2), np.int64),
    )
    (b,) = rows.sparse_batch(2, [3, 2])
    assert b.indices.tolist() == [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
    assert b.values.tolist() == [1, 2, 3, 0, 4, 0] and b.dense_shape.tolist() == [2, 3, 2]
    scalars = [(b.indices.tolist(), b.values.tolist()) for b in Dataset.range(3).sparse_batch(2, [])]
    assert scalars == [([[0], [1]], [0, 1]), ([[0]], [2])]
    with pytest.raises(InvalidArgumentError, match=r"element 1 has shape \(3,\), larger than row_shape"):
        list(bags.sparse_batch(2, [2]))
    with pytest.raises(InvalidArgumentError, match="not of the rank of row_shape"):
        list(bags.sparse_batch(2, [5, 5]))
    with pytest.raises(InvalidArgumentError, match="elements are one array each"):
        list(Dataset.zip((bags, bags)).sparse_batch(2, [5]))
    for bad in ([-1], "x", None, [1.5], [True]):
        with pytest.raises(InvalidArgumentError, match="sparse_batch: row_shape"):
            bags.sparse_batch(2, bad)


def test_interleave_takes_blocks_from_a_cycle_of_datasets_in_tfs_order():
    ds = Dataset.range(1, 6)
    got = ds.interleave(lambda x: Dataset.from_tensors(x).repeat(6), cycle_length=2, block_length=4)
    assert [int(x) for x in got] == [
        1,
        1,
        1,
        1,
        2,
        2,
        2,
        2,
        1,
        1,
        2,
        2,
        3,
        3,
        3,
        3,
        4,
        4,
        4,
        4,
        3,
        3,
        4,
        4,
        5,
        5,
        5,
        5,
        5,
        5,
    ]
    got = ds.interleave(lambda x: Dataset.from_tensors(x).repeat(3), cycle_length=3, num_parallel_calls=-1)
    assert [int(x) for x in got] == [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 4, 5, 4, 5]
    files = Dataset.from_tensor_slices(np.array([10, 20]))  # as TF's list_files + a reader
    got = files.interleave(lambda f: Dataset.range(int(f), int(f) + 3), cycle_length=2)
    assert [int(x) for x in got] == [10, 20, 11, 21, 12, 22]
    with pytest.raises(InvalidArgumentError, match="interleave: the function must return a Dataset"):
        list(ds.interleave(lambda x: [x], cycle_length=1))
    with pytest.raises(InvalidArgumentError, match="interleave block_length"):
        ds.interleave(lambda x: Dataset.from_tensors(x), block_length=0)


def test_from_tensors_and_reduce():
    one = Dataset.from_tensors((np.arange(3), np.float32(2.0)))
    assert one.cardinality() == 1 and [(a.tolist(), float(b)) for a, b in one] == [([0, 1, 2], 2.0)]
    assert Dataset.range(5).reduce(np.int64(0), lambda total, x: total + x) == 10
    assert Dataset.range(0).reduce(7, lambda total, x: total + x) == 7


def test_take_while_scan_and_unique_give_tfs_elements():
    """The same pipelines on TensorFlow 2.21 gave these elements."""
    assert [int(x) for x in Dataset.range(10).take_while(lambda x: x < 4)] == [0, 1, 2, 3]
    scanned = Dataset.range(5).scan(np.int64(10), lambda s, x: (s + x, s * 2))
    assert [int(x) for x in scanned] == [20, 20, 22, 26, 32]
    assert [int(x) for x in Dataset.from_tensor_slices(np.array([3, 1, 3, 2, 1, 5])).unique()] == [3, 1, 2, 5]
    rows = Dataset.from_tensor_slices(np.array([[1, 2], [1, 2], [3, 4], [1, 3]])).unique()
    assert [r.tolist() for r in rows] == [[1, 2], [3, 4], [1, 3]]  # (any shape, equal in it)
    bags = [np.array([1, 2]), np.array([1]), np.array([1, 2]), np.array([1])]
    varying = Dataset.from_generator(lambda: iter(bags), output_signature=TensorSpec((None,), np.int64))
    assert [r.tolist() for r in varying.unique()] == [[1, 2], [1]]
    records = Dataset.from_generator(lambda: iter([b"a", b"a\x00", b"a"])).unique()
    assert list(records) == [b"a", b"a\x00"]  # (numpy's bytes would drop the NUL)
    with pytest.raises(InvalidArgumentError, match="unique: elements must be integers or strings"):
        list(Dataset.from_tensor_slices(np.ones((2, 2))).unique())
    with pytest.raises(InvalidArgumentError, match="unique takes elements of one component"):
        list(Dataset.from_tensor_slices((np.array([1, 1]), np.array([5, 5]))).unique())
    with pytest.raises(InvalidArgumentError, match="scan_func must return"):
        list(Dataset.range(2).scan(0, lambda s, x: s))
    with pytest.raises(InvalidArgumentError, match="take_while: the predicate must return a scalar bool"):
        list(Dataset.range(2).take_while(lambda x: np.array([True, False])))


def test_choose_from_datasets_as_tf_stopping_or_not_on_an_empty_one():
    choices = Dataset.from_tensor_slices(np.array([0, 1, 1, 0, 0, 0, 1]))
    parts = [Dataset.range(3), Dataset.range(10, 13)]
    assert [int(x) for x in Dataset.choose_from_datasets(parts, choices)] == [0, 10, 11, 1, 2]
    assert [int(x) for x in Dataset.choose_from_datasets(parts, choices, stop_on_empty_dataset=False)] == [
        0,
        10,
        11,
        1,
        2,
        12,
    ]
    with pytest.raises(InvalidArgumentError, match=r"a choice must be an integer scalar in \[0, 2\)"):
        list(Dataset.choose_from_datasets(parts, Dataset.from_tensor_slices(np.array([2]))))
    # datasets of other structures or dtypes are refused, as TF's (they were mixed)
    pairs = Dataset.range(3).map(lambda x: (x, x))
    with pytest.raises(InvalidArgumentError, match="dataset 1's elements .* are not of the structure"):
        list(
            Dataset.choose_from_datasets(
                [pairs, Dataset.range(3)], Dataset.from_tensor_slices(np.array([0, 1]))
            )
        )
    floats = Dataset.range(3).map(lambda x: np.float32(x))
    with pytest.raises(
        InvalidArgumentError, match=r"sample_from_datasets: dataset \d's elements .* not of the"
    ):
        list(Dataset.sample_from_datasets([Dataset.range(3), floats], seed=1))


def test_sample_from_datasets_draws_by_weight_and_runs_every_one_out():
    small, large = Dataset.range(3), Dataset.range(10, 2010)
    everything = sorted(int(x) for x in Dataset.sample_from_datasets([small, large], seed=1))
    assert everything == [0, 1, 2, *range(10, 2010)]  # one runs out: the other goes on
    first = Dataset.range(100_000, 110_000)
    drawn = [int(x) for x in Dataset.sample_from_datasets([first, large], [0.8, 0.2], seed=2).take(1000)]
    share = sum(x >= 100_000 for x in drawn) / 1000
    assert 0.75 < share < 0.85
    stopped = list(Dataset.sample_from_datasets([small, large], seed=1, stop_on_empty_dataset=True))
    assert sum(int(x) < 3 for x in stopped) == 3 and len(stopped) < 2003
    assert [int(x) for x in Dataset.sample_from_datasets([small, large], seed=5)] == [
        int(x) for x in Dataset.sample_from_datasets([small, large], seed=5)
    ]  # a seed repeats the draws
    with pytest.raises(InvalidArgumentError, match="weights must be 2 numbers"):
        Dataset.sample_from_datasets([small, large], [1.0, -1.0])
    with pytest.raises(InvalidArgumentError, match="non-empty list of Datasets"):
        Dataset.sample_from_datasets([])


def test_from_generator_checks_each_element_against_its_signature():
    def gen():
        yield np.array([1, 2]), 1.5
        yield np.array([3, 4, 5]), 2.5

    spec = (TensorSpec((None,), np.int64), TensorSpec((), np.float32))
    got = list(Dataset.from_generator(gen, output_signature=spec))
    assert got[1][0].tolist() == [3, 4, 5] and got[1][1] == np.float32(2.5) and got[1][1].dtype == np.float32
    fixed = Dataset.from_generator(
        gen, output_signature=(TensorSpec((2,), np.int64), TensorSpec((), np.float32))
    )
    with pytest.raises(
        InvalidArgumentError, match=r"yielded an element of shape \(3,\) and dtype int64 where"
    ):
        list(fixed)  # (TF: "`generator` yielded an element of shape (3,) where an element of shape (2,)")
    old = Dataset.from_generator(gen, output_types=(np.int64, np.float32), output_shapes=((None,), ()))
    assert [a.tolist() for a, _ in old] == [[1, 2], [3, 4, 5]]
    with_args = Dataset.from_generator(lambda n: iter(range(n)), output_types=np.int64, args=(3,))
    assert [int(x) for x in with_args] == [0, 1, 2]
    with pytest.raises(InvalidArgumentError, match="a tuple of 2 was expected"):
        list(Dataset.from_generator(lambda: iter([np.int64(1)]), output_signature=spec))


def test_batching_elements_of_different_shapes_is_refused_by_name_and_range_takes_a_dtype():
    ragged = Dataset.from_generator(lambda: iter([np.arange(2), np.arange(3)]))
    with pytest.raises(InvalidArgumentError, match=r"first had shape \(2,\) and element 1 had shape \(3,\)"):
        list(ragged.batch(2))
    assert [x.dtype for x in Dataset.range(2, output_type=np.int32)] == [np.int32, np.int32]
    mapped = Dataset.range(3).map(lambda x: x + 1, synchronous=True, use_unbounded_threadpool=False)
    assert [int(x) for x in mapped] == [1, 2, 3]  # TF's newer map arguments, taken


def _windows(ds):
    return [
        [[int(x) for x in part] for part in w] if isinstance(w, tuple) else [int(x) for x in w] for w in ds
    ]


def test_window_rebatch_counter_and_single_elements_give_tensorflows_elements():
    """The elements TF 2.21 gives for the same pipelines."""
    assert _windows(Dataset.range(7).window(3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert _windows(Dataset.range(7).window(3, shift=2, stride=2)) == [[0, 2, 4], [2, 4, 6], [4, 6], [6]]
    assert _windows(Dataset.range(7).window(3, shift=1, drop_remainder=True)) == [
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
        [3, 4, 5],
        [4, 5, 6],
    ]
    assert _windows(Dataset.range(5).window(2, shift=3)) == [[0, 1], [3, 4]]
    pairs = Dataset.zip((Dataset.range(4), Dataset.range(4)))
    assert _windows(pairs.window(3)) == [[[0, 1, 2], [0, 1, 2]], [[3], [3]]]
    batched = Dataset.range(7).window(3).flat_map(lambda w: w.batch(3))
    assert [b.tolist() for b in batched] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [b.tolist() for b in Dataset.range(10).batch(4).rebatch(3)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9],
    ]
    assert [b.tolist() for b in Dataset.range(10).batch(4).rebatch(3, drop_remainder=True)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
    ]
    assert [int(x) for x in Dataset.counter(start=3, step=2).take(3)] == [3, 5, 7]
    assert Dataset.counter().cardinality() == -1
    assert int(Dataset.range(1).get_single_element()) == 0
    with pytest.raises(InvalidArgumentError, match="Dataset was empty"):
        Dataset.range(0).get_single_element()
    with pytest.raises(InvalidArgumentError, match="more than one element"):
        Dataset.range(2).get_single_element()
    with pytest.raises(InvalidArgumentError, match="window size"):
        Dataset.range(3).window(0)


def test_list_files_and_options_as_tensorflows(tmp_path):
    for name in ("b.txt", "a.txt", "c.csv"):
        (tmp_path / name).write_text("x")
    files = Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False)
    assert list(files) == [str(tmp_path / "a.txt").encode(), str(tmp_path / "b.txt").encode()]
    shuffled = Dataset.list_files([str(tmp_path / "*.txt"), str(tmp_path / "*.csv")], seed=1)
    assert sorted(shuffled) == sorted(str(tmp_path / n).encode() for n in ("a.txt", "b.txt", "c.csv"))
    assert len(shuffled) == 3
    with pytest.raises(InvalidArgumentError, match="No files matched pattern: .*nope"):
        Dataset.list_files(str(tmp_path / "*.nope"))
    options = Options()
    options.experimental_distribute.auto_shard_policy = "DATA"  # TF PS ignores it too
    ds = Dataset.range(3).with_options(options)
    assert ds.options().experimental_distribute.auto_shard_policy == "DATA"
    assert [int(x) for x in ds] == [0, 1, 2] and len(ds) == 3


def test_group_by_window_and_buckets_by_length_give_tensorflows_batches():
    """The batches TF 2.21 gives for the same pipelines: full groups as they fill, the rest
    at the end by ascending key; buckets padded to the batch's longest or to the boundary."""

    def grouped(**kwargs):
        return [b.tolist() for b in Dataset.range(10).group_by_window(**kwargs)]

    assert grouped(key_func=lambda x: x % 3, reduce_func=lambda k, w: w.batch(2), window_size=2) == [
        [0, 3],
        [1, 4],
        [2, 5],
        [6, 9],
        [7],
        [8],
    ]
    assert grouped(key_func=lambda x: x % 2, reduce_func=lambda k, w: w.batch(10), window_size=3) == [
        [0, 2, 4],
        [1, 3, 5],
        [6, 8],
        [7, 9],
    ]
    assert grouped(
        key_func=lambda x: x % 2, reduce_func=lambda k, w: w.batch(10), window_size_func=lambda k: k + 2
    ) == [[0, 2], [1, 3, 5], [4, 6], [8], [7, 9]]
    elements = [[0], [1, 2, 3, 4], [5, 6, 7], [7, 8, 9, 10, 11], [13, 14, 15, 16, 19, 20], [21, 22]]
    sequences = Dataset.from_generator(
        lambda: (np.array(e, np.int64) for e in elements), output_signature=TensorSpec((None,), np.int64)
    )

    def buckets(*args, **kwargs):
        return [
            b.tolist() for b in sequences.bucket_by_sequence_length(lambda e: e.shape[0], *args, **kwargs)
        ]

    by_longest = [
        [[1, 2, 3, 4], [5, 6, 7, 0]],
        [[7, 8, 9, 10, 11, 0], [13, 14, 15, 16, 19, 20]],
        [[0, 0], [21, 22]],
    ]
    assert buckets([3, 5], [2, 2, 2]) == by_longest
    assert buckets([3, 5], [2, 2, 2], drop_remainder=True) == by_longest
    assert buckets([3, 8], [2, 2, 2], pad_to_bucket_boundary=True, padding_values=-1) == [
        [[1, 2, 3, 4, -1, -1, -1], [5, 6, 7, -1, -1, -1, -1]],
        [[7, 8, 9, 10, 11, -1, -1], [13, 14, 15, 16, 19, 20, -1]],
        [[0, -1], [21, 22]],
    ]
    for bad, match in (
        (lambda: buckets([3, 5], [2, 2]), "must equal len\\(bucket_boundaries\\) \\+ 1"),
        (lambda: buckets([5, 3], [2, 2, 2]), "boundaries must ascend"),
        (
            lambda: buckets([3, 5], [2, 2, 2], pad_to_bucket_boundary=True),
            "length < max\\(bucket_boundaries\\)",
        ),
        (
            lambda: grouped(key_func=lambda x: x, reduce_func=lambda k, w: w),
            "window_size or window_size_func",
        ),
        (lambda: grouped(key_func=lambda x: 0.5, reduce_func=lambda k, w: w, window_size=2), "an integer"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            bad()
