"""The compiled table kernels against the numpy reference, bit for bit (property tests).

Each test drives both implementations (``pstrain._kernels.compiled`` and
``pstrain._kernels.reference``) with the same random batches and compares everything a caller
can observe: rows found, rows removed, counts, and the bytes of every array an optimizer step
or a table writes.
"""

from __future__ import annotations

import errno
import functools
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pstrain._formats.numerics.idhash import initial_rows, mix64, row_hash
from pstrain._formats.numerics.optimizer_rules import RULES
from pstrain._kernels import KERNELS, compiled, kernels, reference
from pstrain._kernels.batches import take_examples, take_rows
from pstrain._kernels.id_index import CompactIdIndex, IdIndex
from pstrain.server.ps.tables.dynamic_table import DynamicTable, TableConfig
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(180)

#: Ids from a small range (long probe runs, ids moved back by deletions) or the whole 64-bit space.
IDS = st.one_of(st.integers(-40, 400), st.integers(-(2**63), 2**63 - 1))
BATCH = st.lists(IDS, max_size=300).map(lambda b: list(dict.fromkeys(b)))


#: The kernels the run was told to use, read as this module is collected: each test runs
#: with the ``PSTRAIN_*`` variables cleared (``clean_environ``), after ``KERNELS`` was chosen.
CHOSEN = os.environ.get("PSTRAIN_KERNELS")


def test_the_suite_runs_the_compiled_kernels_unless_told_otherwise():
    expected = "numpy" if CHOSEN == "numpy" else "compiled"
    assert KERNELS is (reference if expected == "numpy" else compiled)
    assert kernels("numpy") is reference and kernels("compiled") is compiled
    with pytest.raises(ValueError, match="PSTRAIN_KERNELS='fast'.*'compiled' or 'numpy'"):
        kernels("fast")


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["insert", "delete", "get"]), BATCH), max_size=25),
    st.sampled_from([0.5, 0.75, 0.875]),
    st.sampled_from([2.0, 1.25]),
    st.sampled_from([IdIndex, CompactIdIndex]),
)
def test_the_id_index_is_the_same_compiled_and_in_numpy(ops, fill, growth, kind):
    """At the default fill (half) and the fuller ones an index of rows on disk keeps: long
    probe runs, and deletions that move ids back along them (round the end of the slots);
    sizes a power of two (doubling) or not (growing by a quarter, as that index does); the
    slots (id, row) side by side or, compact, in two arrays (a row in 32 bits)."""
    fast, slow = kind(4, compiled, fill, growth), kind(4, reference, fill, growth)
    model: dict[int, int] = {}
    row = 0
    for op, batch in ops:
        arr = np.array(batch, np.int64)
        if op == "insert":
            new = np.array([i for i in batch if i not in model], np.int64)
            rows = np.arange(row, row + new.size)
            fast.insert(new, rows)
            slow.insert(new, rows)
            model.update(zip(new.tolist(), rows.tolist()))
            row += new.size
        elif op == "delete":
            want = [model.pop(i, -1) for i in batch]
            assert fast.delete(arr).tolist() == want == slow.delete(arr).tolist()
        probe = np.array(batch + list(model)[:50], np.int64)
        want = [model.get(i, -1) for i in probe.tolist()]
        assert fast.get(probe).tolist() == want == slow.get(probe).tolist()
        assert len(fast) == len(slow) == len(model)
        assert fast.size == slow.size and fast.nbytes == slow.nbytes == fast.size * kind.SLOT_BYTES
        assert len(fast) <= fill * fast.size
    for index in (fast, slow):
        keys, vals = index.items()
        assert dict(zip(keys.tolist(), vals.tolist())) == model


@pytest.mark.parametrize("impl", [compiled, reference], ids=["compiled", "numpy"])
def test_an_index_that_grows_by_a_quarter_holds_at_most_a_quarter_more_slots_than_it_needs(impl):
    """The index of rows on disk (compact, 12 bytes a slot) grows by a quarter, to sizes
    that are not powers of two: its slots stay within a quarter of what its ids need at its
    fill, and every id is found; a row past 32 bits is refused with nothing changed."""
    index, ids = CompactIdIndex(4, impl, 0.75, 1.25), np.random.default_rng(3).permutation(40_000) * 7 - 9_000
    for lo in range(0, ids.size, 1_000):
        index.insert(ids[lo : lo + 1_000], np.arange(lo, lo + 1_000))
        need = (lo + 1_000) / 0.75
        assert need <= index.size <= 1.25 * need + 16
    assert index.size & (index.size - 1), index.size  # (not a power of two: probes wrap round its end)
    assert index.nbytes == 12 * index.size
    np.testing.assert_array_equal(index.get(ids), np.arange(ids.size))
    with pytest.raises(ValueError, match="rows are 0 to 4294967294"):
        index.insert(np.array([-1, -2], np.int64), np.array([5, 2**32 - 1], np.int64))
    assert len(index) == ids.size and (index.get(np.array([-1, -2], np.int64)) == -1).all()
    assert index.delete(ids[::2]).tolist() == list(range(0, ids.size, 2))
    np.testing.assert_array_equal(index.get(ids[1::2]), np.arange(1, ids.size, 2))
    assert (index.get(ids[::2]) == -1).all()
    keys, vals = index.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == dict(zip(ids[1::2].tolist(), range(1, ids.size, 2)))


@settings(max_examples=200, deadline=None)
@given(
    present=BATCH,
    batch=st.lists(IDS, max_size=80),
    data=st.data(),
    order=st.sampled_from(["drawn", "sorted", "sorted distinct"]),
)
def test_a_probe_that_checks_its_ids_distinct_is_the_same_compiled_and_in_numpy(present, batch, data, order):
    """Ids with rows and ids without, repeated or not, in any order or ascending (a sorted
    batch's, which the compiled probe takes as distinct without marks): the rows found are
    ``get``'s, the answer is whether the batch repeats an id, and the marks are all clear
    again after, the index's slots as they were (the compiled probe marks its slots)."""
    if batch:
        batch += data.draw(st.lists(st.sampled_from(batch), max_size=3))  # repeats, sometimes
        batch = data.draw(st.permutations(batch))
    if order != "drawn":
        batch = sorted(set(batch) if order == "sorted distinct" else batch)
    arr = np.array(batch, np.int64)
    model = {i: r for r, i in enumerate(present)}
    for impl in (compiled, reference):
        index = IdIndex(4, impl)
        index.insert(np.array(present, np.int64), np.arange(len(present)))
        marks = np.zeros(max(1, len(present)), np.uint8)
        before = index.slots.copy()
        got = index.locate(arr, marks)
        np.testing.assert_array_equal(index.slots, before)
        if len(set(batch)) != len(batch):
            assert got is None
        else:
            assert got is not None and got.tolist() == [model.get(i, -1) for i in batch]
        assert not marks.any()


@settings(max_examples=150, deadline=None)
@given(present=BATCH, batch=BATCH, later=BATCH, data=st.data())
def test_an_updates_rows_brought_up_to_date_are_the_same_compiled_and_in_numpy(present, batch, later, data):
    """The rows a lookup found, looked for again after more ids came in: an id that had no
    row gets the one it has now (or -1 still), an id that had one keeps what the caller
    holds (never probed again), and the ids still without one are those ``absent`` gives;
    two batches are the same ids only in the same order."""
    later = [i for i in later if i not in set(present)]
    model = {i: r for r, i in enumerate(present + later)}
    arr = np.array(batch, np.int64)
    for impl in (compiled, reference):
        index = IdIndex(4, impl)
        index.insert(np.array(present, np.int64), np.arange(len(present)))
        pos = index.get(arr)
        pos[pos >= 0] += 10_000  # what the caller holds for them, kept as it is
        index.insert(np.array(later, np.int64), np.arange(len(present), len(model)))
        index.refind(arr, pos)
        assert pos.tolist() == [model[i] + 10_000 if i in set(present) else model.get(i, -1) for i in batch]
        with pytest.raises(ValueError, match="rows for"):
            impl.index_refind(index.slots, index.size, arr, np.full(arr.size + 1, -1, np.int64))
        where, which = impl.absent(arr, pos)
        assert where.dtype == which.dtype == np.int64
        assert where.tolist() == [i for i, p in enumerate(pos.tolist()) if p < 0]
        assert which.tolist() == [batch[i] for i in where.tolist()]
    other = data.draw(st.one_of(st.just(list(batch)), st.permutations(batch), BATCH))
    a, b = arr, np.array(other, np.int64)
    assert compiled.same_ids(a, b) is reference.same_ids(a, b) is (batch == other)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.lists(st.integers(0, 60), max_size=40).map(lambda b: list(dict.fromkeys(b))), max_size=12
    ),
    threshold=st.integers(1, 4),
    limit=st.integers(1, 30),
)
def test_counting_sightings_is_the_same_compiled_and_in_numpy_and_in_python(steps, threshold, limit):
    """One pass per batch: an id is admitted at its ``threshold``-th sighting (and forgotten
    as a candidate); the others are counted, the new ones remembered up to ``room`` (the
    pass stops before the id that would be one more)."""
    indexes = [IdIndex(4, compiled), IdIndex(4, reference)]
    arrays = [(np.zeros(64 * 13, np.int64), np.zeros(64 * 13, np.int64)) for _ in indexes]
    model: dict[int, int] = {}
    used = 0
    for batch in steps:
        ids = np.array(batch, np.int64) * 7919 - 200
        room = max(0, limit - len(model))
        results = []
        where = np.arange(ids.size, dtype=np.int64) * 3 + 1  # the ids' places in a lookup
        for index, (counts, owners) in zip(indexes, arrays):
            admitted = np.full(ids.size, -7, np.int64)
            done, added, admits = index.count_sightings(
                ids, where, counts, owners, admitted, threshold, used, room
            )
            assert (admitted[admits:] == -7).all()  # nothing written past the ids admitted
            results.append((done, added, admitted[:admits].tolist()))
        assert results[0] == results[1]
        done, added, admitted = results[0]
        admitted = [int(i in set(admitted)) for i in where[:done].tolist()]
        want, fresh = [], 0
        for i in ids.tolist():
            c = model.get(i, 0) + 1
            if c < threshold and i not in model:
                if fresh == room:
                    break
                fresh += 1
            want.append(int(c >= threshold))
            if c >= threshold:
                model.pop(i, None)
            else:
                model[i] = c
        assert (done, added, admitted) == (len(want), fresh, want)
        for index, (counts, owners) in zip(indexes, arrays):
            keys, slots = index.items()
            assert {k: int(counts[s]) for k, s in zip(keys.tolist(), slots.tolist())} == model
            assert all(owners[s] == k for k, s in zip(keys.tolist(), slots.tolist()))
            gone = np.setdiff1d(np.arange(used + added), slots)
            assert not counts[gone].any()  # a slot whose id left: count 0 (forgetting reads it)
        used += added


@settings(max_examples=150, deadline=None)
@given(
    epochs=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    since=st.integers(-1, 2**32),
    live=st.one_of(st.none(), st.lists(st.booleans(), min_size=300, max_size=310)),
    until=st.one_of(st.none(), st.integers(-1, 2**32)),
)
def test_the_rows_changed_after_a_mark_are_the_same_compiled_and_in_numpy(epochs, since, live, until):
    e = np.array(epochs, np.uint32)
    flags = None if live is None else np.array(live, bool).view(np.uint8)
    want = [
        i
        for i, x in enumerate(epochs)
        if x > since and (until is None or x <= until) and (live is None or live[i])
    ]
    for impl in (compiled, reference):
        got = impl.rows_after(e, since, flags, until=until)
        assert got.dtype == np.int64 and got.tolist() == want
    with pytest.raises(ValueError, match="live flags"):
        compiled.rows_after(np.zeros(5, np.uint32), 0, np.zeros(4, np.uint8))


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 40),
    dim=st.integers(0, 5),
    dtype=st.sampled_from([np.float32, np.float64]),
    data=st.data(),
)
def test_keeping_a_deltas_rows_is_the_same_compiled_and_in_numpy(n, dim, dtype, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    array = rng.standard_normal((n, dim)).astype(dtype)
    epochs = rng.integers(0, 6, n + data.draw(st.integers(0, 3))).astype(np.uint32)
    rows = np.array(data.draw(st.lists(st.integers(-3, n + 3), max_size=50)), np.int64)
    if data.draw(st.booleans()):
        rows = np.unique(rows)  # a sparse step's rows: strictly ascending
    since, mark = data.draw(st.integers(-1, 6)), data.draw(st.integers(-1, 6))
    taken = data.draw(st.integers(0, n + 1))
    start = data.draw(st.integers(0, 4))
    ascending = bool(np.all(rows[1:] > rows[:-1]))
    want = [int(r) for r in rows if taken <= r < n and since < epochs[r] <= mark] if ascending else None
    for impl in (compiled, reference):
        kept_rows = np.full(start + rows.size + 2, -7, np.int64)
        kept_values = np.full((start + rows.size + 2, dim), -7.0, dtype)
        got = impl.keep_changed(rows, epochs, since, mark, taken, array, kept_rows, kept_values, start)
        if want is None:
            assert got == -1 and (kept_rows == -7).all() and (kept_values == -7.0).all()
            continue
        assert got == len(want)
        assert kept_rows[start : start + got].tolist() == want
        assert _bits(kept_values[start : start + got]) == _bits(array[want])
        assert (kept_rows[:start] == -7).all() and (kept_rows[start + got :] == -7).all()
    for impl in (compiled, reference):
        with pytest.raises(ValueError, match="no room"):
            impl.keep_changed(
                np.arange(3),
                np.zeros(5, np.uint32),
                0,
                1,
                0,
                np.zeros((5, 2), dtype),
                np.empty(2, np.int64),
                np.empty((2, 2), dtype),
                0,
            )
        with pytest.raises(ValueError, match="epochs for"):
            impl.keep_changed(
                np.arange(1),
                np.zeros(1, np.uint32),
                0,
                1,
                0,
                np.zeros((5, 2), dtype),
                np.empty(2, np.int64),
                np.empty((2, 2), dtype),
                0,
            )


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["sgd", "adagrad"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    n=st.integers(1, 60),
    dim=st.integers(1, 9),
    data=st.data(),
)
def test_the_fused_sparse_steps_are_the_numpy_rules_bit_for_bit(kind, dtype, n, dim, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)), np.int64)
    missing = rng.random(rows.size) < 0.2  # a table's ids with no row come as -1
    rows[missing] = -1
    lr = data.draw(st.floats(1e-4, 2.0))
    eps = data.draw(st.sampled_from([1e-7, 1e-3, 0.1]))
    var0 = rng.standard_normal((n, dim)).astype(dtype)
    acc0 = (rng.random((n, dim)) * 0.5 + 0.1).astype(dtype)
    g = (rng.standard_normal((rows.size, dim)) * rng.choice([1e-3, 1.0, 1e3])).astype(dtype)
    results = []
    for impl in (compiled, reference):
        var, acc = var0.copy(), acc0.copy()
        if kind == "sgd":
            impl.sgd_rows(var, rows, g, lr)
        else:
            impl.adagrad_rows(var, acc, rows, g, lr, eps)
        results.append((_bits(var), _bits(acc)))
    # and the rule as the ps ran it before the kernels (numpy, the rows that exist)
    keep = rows >= 0
    var, acc = var0.copy(), acc0.copy()
    r, gr = rows[keep], g[keep]
    if kind == "sgd":
        var[r] -= lr * gr
    else:
        a = acc[r] + gr * gr
        acc[r] = a
        var[r] -= lr * gr / np.sqrt(a + eps)
    assert results[0] == results[1] == (_bits(var), _bits(acc))
    # the rule the ps calls takes the kernel path for these and gives the same bytes
    var, acc = var0.copy(), acc0.copy()
    cfg = {"kind": kind, "learning_rate": lr, "epsilon": eps}
    RULES[kind](var, g, rows, {"accumulator": acc}, cfg, 1)
    assert (_bits(var), _bits(acc)) == results[0]


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["sgd", "adagrad"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    shape=st.lists(st.integers(1, 7), max_size=3),
    data=st.data(),
)
def test_the_dense_steps_through_the_row_kernels_are_the_numpy_rules_bit_for_bit(kind, dtype, shape, data):
    """A dense variable's SGD or Adagrad step, which the rule takes through the row kernel
    (the whole array as one row), gives numpy's bytes; so do the cases it leaves to numpy."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lr = data.draw(st.floats(1e-4, 2.0))
    eps = data.draw(st.sampled_from([1e-7, 1e-3, 0.1]))
    var0 = np.asarray(rng.standard_normal(shape), dtype)  # (arrays, 0-d ones too)
    acc0 = np.asarray(rng.random(shape) * 0.5 + 0.1, dtype)
    g = np.asarray(rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 1e3]), dtype)
    var, acc = var0.copy(), acc0.copy()
    if kind == "sgd":
        var -= lr * g
    else:
        acc += g * g
        var -= lr * g / np.sqrt(acc + eps)
    expected = (_bits(var), _bits(acc))
    ways = [(float, g), (dtype, g)]  # the kernel; numpy (a numpy scalar rate)
    if g.ndim >= 2:
        ways.append((float, np.asfortranarray(g)))  # numpy, unless that is C-contiguous too
    for lr_as, g_as in ways:
        var, acc = var0.copy(), acc0.copy()
        cfg = {"kind": kind, "learning_rate": lr_as(lr), "epsilon": eps}
        RULES[kind](var, g_as, None, {"accumulator": acc}, cfg, 1)
        assert (_bits(var), _bits(acc)) == expected


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    n=st.integers(1, 40),
    dim=st.integers(1, 9),
    narrow=st.booleans(),
    data=st.data(),
)
def test_row_wise_adagrad_is_the_same_compiled_and_in_numpy_and_in_the_rule(dtype, n, dim, narrow, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)), np.int64)
    rows[rng.random(rows.size) < 0.2] = -1  # a table's ids with no row
    lr, eps = data.draw(st.floats(1e-4, 2.0)), data.draw(st.sampled_from([1e-8, 1e-3]))
    var0 = rng.standard_normal((n, dim)).astype(dtype)
    acc0 = (rng.random((n, 1)) * 0.5).astype(dtype)  # a row's one value: a variable's slot,
    if not narrow:  # or repeated, a dynamic table's
        acc0 = np.repeat(acc0, dim, axis=1)
    g = rng.standard_normal((rows.size, dim)).astype(dtype)
    results = []
    for impl in (compiled, reference):
        var, acc = var0.copy(), acc0.copy()
        impl.rowwise_adagrad_rows(var, acc, rows, g, lr, eps)
        results.append((_bits(var), _bits(acc)))
    var, acc = var0.copy(), acc0.copy()
    RULES["rowwise_adagrad"](var, g, rows, {"accumulator": acc}, {"learning_rate": lr, "epsilon": eps}, 1)
    assert results[0] == results[1] == (_bits(var), _bits(acc))
    keep = rows[rows >= 0]  # and TorchRec's formula, plainly
    ref_var, ref_acc = var0.astype(np.float64), acc0.astype(np.float64)
    gk = g[rows >= 0].astype(np.float64)
    ref_acc[keep] += (gk * gk).mean(1, keepdims=True)  # (broadcast over a wide slot's columns)
    ref_var[keep] -= lr * gk / (np.sqrt(ref_acc[keep]) + eps)
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(var, ref_var, rtol=tol, atol=tol)
    np.testing.assert_allclose(acc, ref_acc, rtol=tol, atol=tol)


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    bags=st.integers(0, 30),
    rows=st.integers(1, 30),
    width=st.integers(1, 40),
    weighted=st.booleans(),
    scatter=st.booleans(),
    data=st.data(),
)
def test_pooling_bags_is_the_same_compiled_and_in_numpy(dtype, bags, rows, width, weighted, scatter, data):
    """Bags pooled (and scattered back) from rows: the compiled loop, numpy's and a loop by
    hand agree bit for bit, with factors or without (all 1), into columns of wider arrays;
    the rows ahead that the loop asks for early never change the result."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lengths = rng.integers(0, 6, bags)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    n = int(offsets[-1])
    idx = rng.integers(0, rows, n + data.draw(st.integers(0, 3))).astype(
        np.int64
    )  # ids past the last bag: unused
    scale = rng.standard_normal(idx.size).astype(dtype) if weighted else np.zeros(0, dtype)
    out_col, src_col = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 3))
    out_rows, src_rows = (rows, bags) if scatter else (bags, rows)
    src = rng.standard_normal((src_rows, width + 3)).astype(dtype)
    results = []
    for impl in (compiled, reference):
        out = np.ones((out_rows, width + 2), dtype)
        impl.pool_bags(out, offsets, src, idx, scale, out_col, src_col, width, scatter)
        results.append(_bits(out))
    expected = np.ones((out_rows, width + 2), dtype)
    for b in range(bags):
        for i in range(offsets[b], offsets[b + 1]):
            o, r = (idx[i], b) if scatter else (b, idx[i])
            part = src[r, src_col : src_col + width]
            expected[o, out_col : out_col + width] += scale[i] * part if weighted else part
    assert results[0] == results[1] == _bits(expected)


@pytest.mark.parametrize("scatter", [False, True])
def test_a_bag_or_row_outside_is_refused_before_anything_is_pooled(scatter):
    """A row past the distinct rows, a bag past the output, offsets that go back or past
    the ids: both kernels refuse them before anything is added."""
    offsets = np.array([0, 2, 3], np.int64)
    idx = np.array([0, 1, 2], np.int64)
    ones = np.zeros(0, np.float32)
    bad = [  # (offsets, idx, rows of the distinct side)
        (offsets, np.array([0, 1, 3], np.int64), 3),  # a row past the distinct rows
        (np.array([0, 1, 2, 3], np.int64), idx, 3),  # a bag past the bags' side
        (np.array([0, 2, 1], np.int64), idx, 3),  # offsets going back
        (np.array([0, 2, 4], np.int64), idx, 3),  # past the ids
        (np.array([1, 2, 3], np.int64), idx, 3),  # not from the first id
        (offsets, np.array([0, -1, 2], np.int64), 3),  # below 0
    ]
    for impl in (compiled, reference):
        for offs, ids, rows in bad:
            out = np.zeros((rows, 4) if scatter else (2, 4), np.float32)
            src = np.ones((2, 4) if scatter else (rows, 4), np.float32)
            with pytest.raises(IndexError, match="outside"):
                impl.pool_bags(out, offs, src, ids, ones, 0, 0, 4, scatter)
            assert not out.any(), (impl, offs, ids)
        with pytest.raises(ValueError, match="scale not one per id"):
            impl.pool_bags(
                np.zeros((3, 4), np.float32),
                offsets,
                np.ones((3, 4), np.float32),
                idx,
                np.ones(2, np.float32),
            )
        with pytest.raises(ValueError, match="no offsets"):
            impl.pool_bags(
                np.zeros((3, 4), np.float32), np.zeros(0, np.int64), np.ones((3, 4), np.float32), idx, ones
            )


def test_a_row_past_the_end_is_refused_by_both_and_nothing_changes():
    """A row outside a variable or a table (past its end; below 0 in an id index) is refused
    by both kernels before anything is written."""
    for impl in (compiled, reference):
        var = np.zeros((4, 2), np.float32)
        acc = np.ones((4, 2), np.float32)
        with pytest.raises(IndexError, match="past the variable's end"):
            impl.adagrad_rows(var, acc, np.array([4], np.int64), np.ones((1, 2), np.float32), 0.1, 1e-7)
        with pytest.raises(IndexError, match="past the variable's end"):
            impl.sgd_rows(var, np.array([9], np.int64), np.ones((1, 2), np.float32), 0.1)
        assert not var.any() and (acc == 1).all()
        with pytest.raises(IndexError, match="past the table's end"):
            impl.gather_rows(var, np.array([0, 4], np.int64), np.empty((2, 2), np.float32), 0.0)
        epochs, last, freq = np.zeros(4, np.uint32), np.zeros(4, np.int64), np.zeros(4, np.int64)
        with pytest.raises(IndexError, match="past the table's end"):
            impl.stamp_rows(epochs, np.array([0, 4], np.int64), 7)
        flags = np.zeros(1, np.uint8)
        with pytest.raises(IndexError, match="past the table's end"):
            impl.flag_rows(flags, np.array([0, 4], np.int64), 4)
        with pytest.raises(ValueError, match="2 bytes of bits for 4 rows"):
            impl.flag_rows(np.zeros(2, np.uint8), np.array([0], np.int64), 4)
        with pytest.raises(ValueError, match="2 bytes of bits for 4 rows"):
            impl.stamp_flagged(np.ones(2, np.uint8), epochs, 7)
        assert not flags.any()
        with pytest.raises(IndexError, match="past the table's end"):
            impl.gather_rows(
                var, np.array([1, 4], np.int64), np.empty((2, 2), np.float32), 0.0, last, freq, 7
            )
        with pytest.raises(ValueError, match="shorter than the table"):
            impl.gather_rows(
                var, np.array([1], np.int64), np.empty((1, 2), np.float32), 0.0, None, freq[:3], 7
            )
        assert not epochs.any() and not last.any() and not freq.any()
        index = IdIndex(4, impl)
        index.insert(np.array([5], np.int64), np.array([0]))
        with pytest.raises(ValueError, match="row -1: rows are at least 0"):
            index.insert(np.array([6, 7], np.int64), np.array([1, -1]))
        assert len(index) == 1 and index.get(np.array([5, 6, 7])).tolist() == [0, -1, -1]


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 50),
    dim=st.integers(1, 6),
    default=st.floats(-2, 2, width=32),
    pos=st.lists(st.integers(-1, 49), max_size=60),
    clock=st.integers(0, 2**40),
    ages=st.booleans(),
    counts=st.booleans(),
)
def test_a_lookups_gather_and_bookkeeping_are_the_same_compiled_and_in_numpy(
    n, dim, default, pos, clock, ages, counts
):
    rows = np.array([p if p < n else -1 for p in dict.fromkeys(pos)], np.int64)
    table = np.arange(n * dim, dtype=np.float32).reshape(n, dim)
    seen = []
    for impl in (compiled, reference):
        out = np.full((rows.size, dim), np.nan, np.float32)
        last, freq = np.zeros(n, np.int64), np.arange(n, dtype=np.int64)
        impl.gather_rows(table, rows, out, default, last if ages else None, freq if counts else None, clock)
        seen.append((_bits(out), _bits(last), _bits(freq)))
    assert seen[0] == seen[1]
    hit = np.zeros(n, bool)
    hit[rows[rows >= 0]] = True
    assert seen[0][1] == _bits(np.where(hit & ages, clock, 0))
    assert seen[0][2] == _bits(np.arange(n) + (hit & counts))
    want = np.where((rows >= 0)[:, None], table[np.maximum(rows, 0)], np.float32(default))
    assert seen[0][0] == _bits(want)
    stamped = []  # an update's bookkeeping: the epoch of each row it changed, and how many
    for impl in (compiled, reference):
        epochs = np.arange(n, dtype=np.uint32)
        stamped.append((impl.stamp_rows(epochs, rows, clock % 2**32), _bits(epochs)))
    assert (
        stamped[0]
        == stamped[1]
        == (int(hit.sum()), _bits(np.where(hit, clock % 2**32, np.arange(n)).astype(np.uint32)))
    )


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 200),
    updates=st.lists(st.lists(st.integers(-1, 199), max_size=40), max_size=6),
    epoch=st.integers(0, 2**32 - 1),
)
def test_rows_flagged_then_stamped_get_the_epochs_stamping_each_update_gives(n, updates, epoch):
    """Updates that flag their rows, then one stamp of the flagged rows, leave the epochs
    (and the counts) that stamping each update's rows directly leaves, compiled and in
    numpy; the flags are all clear after, and a second stamp changes nothing."""
    batches = [np.array([r for r in u if r < n], np.int64) for u in updates]
    want = np.arange(n, dtype=np.uint32)
    direct = sum(reference.stamp_rows(want, rows, epoch) for rows in batches)
    for impl in (compiled, reference):
        epochs, flags = np.arange(n, dtype=np.uint32), np.zeros((n + 7) // 8, np.uint8)
        flagged = sum(impl.flag_rows(flags, rows, n) for rows in batches)
        assert flagged == direct
        changed = {int(r) for rows in batches for r in rows if r >= 0}
        assert impl.stamp_flagged(flags, epochs, epoch) == len(changed)
        assert _bits(epochs) == _bits(want) and not flags.any()
        assert impl.stamp_flagged(flags, epochs, epoch + 1 if epoch < 2**32 - 1 else 0) == 0
        assert _bits(epochs) == _bits(want)


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(
        st.one_of(st.integers(0, 6), st.integers(0, 2**62), st.integers(-(2**63), 2**63 - 1)),
        min_size=1,
        max_size=80,
    ),
    data=st.data(),
)
def test_an_evictions_victims_are_the_same_compiled_and_in_numpy(keys, data):
    """The n live, unprotected rows of smallest key, ties to the lowest rows (or, given a
    tiebreak, to the rows of smallest tiebreak, then the lowest), ascending: the C
    histograms against numpy's partition, over small clocks and the whole int64 range."""
    size = len(keys)
    key = np.array(keys, np.int64)
    live = np.array(data.draw(st.lists(st.booleans(), min_size=size, max_size=size)), np.uint8)
    protect = np.array(data.draw(st.lists(st.integers(0, size - 1), max_size=10, unique=True)), np.int64)
    used = data.draw(st.integers(0, size))
    n = data.draw(st.integers(-1, size + 2))
    got = []
    for impl in (compiled, reference):
        mark = np.zeros(size, np.uint8)
        got.append(impl.pick_victims(key, live, protect[protect < used], mark, used, n))
        assert not mark.any()
    # bounds of the keys spare the kernel a pass (LRU's: 0 and the clock); bounds that miss
    # a key, or none (high < low), give the same rows
    lo, hi = min(keys), max(keys)
    wide = data.draw(st.tuples(st.integers(-(2**63), lo), st.integers(hi, 2**63 - 1)))
    other = data.draw(st.tuples(st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1)))
    for low, high in ((lo, hi), wide, other):
        mark = np.zeros(size, np.uint8)
        got.append(compiled.pick_victims(key, live, protect[protect < used], mark, used, n, low, high))
        assert not mark.any()
    for victims in got[1:]:
        np.testing.assert_array_equal(got[0], victims)
    eligible = [r for r in range(used) if live[r] and r not in set(protect.tolist())]
    want = sorted(sorted(eligible, key=lambda r: (key[r], r))[: max(0, n)])
    assert got[0].tolist() == want
    # LFU's ties: the rows of smallest tiebreak (the last lookup) first, then the lowest
    tiebreak = np.array(
        data.draw(
            st.lists(
                st.one_of(st.integers(0, 3), st.integers(-(2**63), 2**63 - 1)), min_size=size, max_size=size
            )
        ),
        np.int64,
    )
    by_both = []
    for impl in (compiled, reference):
        mark = np.zeros(size, np.uint8)
        by_both.append(impl.pick_victims(key, live, protect[protect < used], mark, used, n, 0, -1, tiebreak))
        assert not mark.any()
    want = sorted(sorted(eligible, key=lambda r: (key[r], tiebreak[r], r))[: max(0, n)])
    assert by_both[0].tolist() == by_both[1].tolist() == want


@settings(max_examples=100, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
    dim=st.integers(0, 20),
    seed=st.integers(-(2**63), 2**64 - 1),
    low=st.floats(-10, 10),
    span=st.floats(0, 10),
    dtype=st.sampled_from(["float32", "float64", "float16"]),
)
def test_a_new_rows_initial_values_are_the_formulas_bit_for_bit(ids, dim, seed, low, span, dtype):
    """A dynamic table's new rows: the C kernel, and numpy's reference, give the formula
    pstrain has always used, so rows and checkpoints of earlier versions stay the same."""

    arr = np.asarray(ids, np.int64)
    u = arr.view(np.uint64).reshape(-1, 1)
    cols = np.arange(dim, dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        key = mix64(
            u * np.uint64(0x9E3779B97F4A7C15)
            ^ mix64(np.uint64(seed & (2**64 - 1)) + cols * np.uint64(0x2545F4914F6CDD1D))
        )
    unit = (key >> np.uint64(11)).astype(np.float64) * 2.0**-53
    high = low + span
    want = (low + (high - low) * unit).astype(dtype)
    got = initial_rows(arr, dim, np.dtype(dtype), seed, low, high)
    assert got.dtype == want.dtype and got.shape == (arr.size, dim)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    out = np.empty((arr.size, dim))
    reference.initial_rows(arr, seed & (2**64 - 1), 0x9E3779B97F4A7C15, 0x2545F4914F6CDD1D, low, high, out)
    np.testing.assert_array_equal(out, low + (high - low) * unit)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 40),
    dim=st.integers(1, 20),
    inits=st.lists(st.floats(-1, 1), max_size=10),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**64 - 1),
    low=st.floats(-10, 10),
    span=st.floats(0, 10),
    data=st.data(),
)
def test_a_dynamic_tables_new_rows_are_the_same_compiled_and_in_numpy(
    n, dim, inits, dtype, seed, low, span, data
):
    """New rows anywhere in a table, in one pass: their values are the initial-row formula,
    every optimizer slot its initial value, and their bookkeeping (id, live, last lookup,
    count, change epoch) set; nothing else changes, the bytes of every array the same
    compiled and in numpy. A row outside the table is refused by both, nothing written."""

    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)), np.int64)
    new_ids = np.array(data.draw(st.lists(IDS, min_size=rows.size, max_size=rows.size)), np.int64)

    def table():
        rng = np.random.default_rng(3)
        return [
            rng.standard_normal((n, dim)).astype(dtype),
            *(rng.standard_normal((n, dim)).astype(dtype) for _ in inits),
            rng.integers(-9, 9, n),
            rng.integers(0, 2, n).astype(np.uint8),
            rng.integers(0, 9, n),
            rng.integers(0, 9, n),
            rng.integers(0, 9, n).astype(np.uint32),
        ]

    def create(impl, arrays, at, ids):
        values, *slots, book_ids, live, last_seen, freq, epochs = arrays
        impl.create_rows(
            at,
            ids,
            values,
            tuple(slots),
            tuple(inits),
            book_ids,
            live,
            last_seen,
            freq,
            epochs,
            17,
            5,
            *row_hash(seed),
            low,
            low + span,
        )

    before, got = table(), []
    for impl in (compiled, reference):
        arrays = table()
        create(impl, arrays, rows, new_ids)
        got.append(arrays)
        outside = table()
        with pytest.raises(IndexError, match="outside the table"):
            create(impl, outside, np.array([0, n], np.int64), np.array([1, 2], np.int64))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(outside, before))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*got))
    values, *slots, book_ids, live, last_seen, freq, epochs = got[0]
    want = initial_rows(new_ids, dim, np.dtype(dtype), seed, low, low + span)
    assert values[rows].tobytes() == want.tobytes()
    for slot, init in zip(slots, inits):
        assert np.all(slot[rows] == dtype(init))
    assert book_ids[rows].tolist() == new_ids.tolist() and np.all(live[rows] == 1)
    assert np.all(last_seen[rows] == 17) and np.all(freq[rows] == 0) and np.all(epochs[rows] == 5)
    others = np.setdiff1d(np.arange(n), rows)
    assert all(a[others].tobytes() == b[others].tobytes() for a, b in zip(got[0], before))


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 30),
    dim=st.integers(1, 12),
    inits=st.lists(st.sampled_from([0.0, -0.0, 0.1, 1.0]), max_size=3),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_rows_as_their_table_made_them_are_told_apart_bit_for_bit_compiled_and_in_numpy(
    n, dim, inits, dtype, seed, data
):
    """``as_created``: which rows hold what ``create_rows`` made them (initial values, each
    slot at its initial value, a count of 0), bit for bit. Rows made, then some changed in
    one cell (by a value that compares equal, -0.0 for 0.0, or not; NaN; a count), and the
    answer is the rows left alone, compiled and in numpy; ``initial_rows`` is
    ``create_rows``'s values. A row outside the table is refused by both."""
    low, high = (-0.05, 0.05) if data.draw(st.booleans()) else (0.0, 0.0)  # (rows of 0.0 too)
    ids = np.array(data.draw(st.lists(IDS, min_size=n, max_size=n, unique=True)), np.int64)
    values = np.full((n, dim), 7, dtype)
    slots = tuple(np.full((n, dim), 7, dtype) for _ in inits)
    book = [np.zeros(n, np.int64), np.zeros(n, np.uint8), np.zeros(n, np.int64), np.full(n, 3, np.int64)]
    freq = book[3]
    every = np.arange(n, dtype=np.int64)
    compiled.create_rows(
        every, ids, values, slots, tuple(inits), book[0], book[1], book[2], freq,
        np.zeros(n, np.uint32), 1, 1, *row_hash(seed), low, high,
    )  # fmt: skip
    made = np.empty((n, dim), dtype)
    for impl in (compiled, reference):
        made[:] = 9
        impl.initial_rows(ids, *row_hash(seed), low, high, made)
        assert made.tobytes() == values.tobytes()
    changed = np.zeros(n, bool)
    for row in data.draw(st.lists(st.integers(0, n - 1), max_size=n)):
        arrays = [values, *slots]
        arr = arrays[data.draw(st.integers(0, len(arrays) - 1))]
        col = data.draw(st.integers(0, dim - 1))
        how = data.draw(st.sampled_from(["negate", "nan", "nudge", "count"]))
        if how == "count":
            freq[row] = 1
        elif how == "negate":  # -0.0 for 0.0 compares equal, and is not what was made
            arr[row, col] = -arr[row, col]
        elif how == "nan":
            arr[row, col] = np.nan
        else:
            arr[row, col] = np.nextafter(arr[row, col], dtype(1), dtype=dtype)
        changed[row] = True
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n)), np.int64)
    answers = []
    for impl in (compiled, reference):
        out = np.full(rows.size, 5, np.uint8)
        impl.as_created(rows, ids[rows], values, slots, tuple(inits), freq, *row_hash(seed), low, high, out)
        answers.append(out.tolist())
        with pytest.raises(IndexError, match="outside the table"):
            impl.as_created(
                np.array([n], np.int64), ids[:1], values, slots, tuple(inits), freq, *row_hash(seed),
                low, high, np.empty(1, np.uint8),
            )  # fmt: skip
    bits = f"u{values.itemsize}"
    same = (values.view(bits) == made.view(bits)).all(axis=1)
    for slot, init in zip(slots, inits):
        same &= (slot.view(bits) == np.array(init, dtype).view(bits)).all(axis=1)
    same &= freq == 0
    assert answers[0] == answers[1] == same[rows].astype(np.uint8).tolist()
    assert same[~changed].all()  # (a changed row may be changed back: its bits decide)


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(0, 4), max_size=2),
    n=st.integers(1, 300),
    dtype=st.sampled_from([np.float32, np.float64, np.int32, np.int8]),
    data=st.data(),
)
def test_taking_rows_is_numpys_fancy_index_bit_for_bit(shape, n, dtype, data):
    """What a fixed table's sparse read and a save's writer gather rows with: many rows
    (past the kernel's prefetch distance), of any width, repeated and unordered."""

    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    array = (rng.standard_normal((n, *shape)) * 100).astype(dtype)
    rows = np.asarray(data.draw(st.lists(st.integers(0, n - 1), max_size=200)), np.int64)
    if data.draw(st.booleans()):
        rows = rows.astype(np.int32)
    got = take_rows(array, rows)
    assert got.dtype == array.dtype and got.shape == array[rows].shape
    np.testing.assert_array_equal(got, array[rows])


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 50),
    dim=st.integers(1, 6),
    pos=st.lists(st.integers(-1, 49), max_size=60),
    double=st.booleans(),
)
def test_a_deltas_rows_are_put_in_the_same_compiled_and_in_numpy(n, dim, pos, double):
    rows = np.array([p if p < n else -1 for p in dict.fromkeys(pos)], np.int64)
    dtype = np.float64 if double else np.float32
    values = -np.arange(rows.size * dim, dtype=dtype).reshape(rows.size, dim)
    got = []
    for impl in (compiled, reference):
        out = np.arange(n * dim, dtype=dtype).reshape(n, dim)
        impl.put_rows(out, rows, values)
        got.append(_bits(out))
    assert got[0] == got[1]
    for impl in (compiled, reference):
        out = np.zeros((n, dim), dtype)
        with pytest.raises(IndexError, match="past the array's end"):
            impl.put_rows(out, np.array([n], np.int64), np.ones((1, dim), dtype))


TABLES = st.sampled_from(
    [
        TableConfig(dim=3),
        TableConfig(dim=4, capacity=40, admit_after=2, evict="lru"),
        TableConfig(dim=2, capacity=25, evict="lfu", max_candidates=30, admit_after=3),
        TableConfig(dim=5, admit_probability=0.5, max_age=6),
    ]
)


@settings(max_examples=60, deadline=None)
@given(
    config=TABLES,
    kind=st.sampled_from(["sgd", "adagrad", "adam"]),
    steps=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 120), max_size=60)), max_size=20),
)
def test_a_dynamic_table_trains_the_same_compiled_and_in_numpy(config, kind, steps):
    fast = DynamicTable("t", config, kernels=compiled)
    slow = DynamicTable("t", config, kernels=reference)
    cfg = {"kind": kind, "learning_rate": 0.1, "epsilon": 1e-7}
    slots = (
        {"accumulator": ("acc", 0.1)}
        if kind == "adagrad"
        else {"m": ("m", 0.0), "v": ("v", 0.0)}
        if kind == "adam"
        else {}
    )
    for t, (train, batch) in enumerate(steps, 1):
        ids = np.array(list(dict.fromkeys(batch)), np.int64) * 7919 - 300
        outs = [table.lookup(ids, train) for table in (fast, slow)]
        assert _bits(outs[0]) == _bits(outs[1])
        if train:
            grad = np.sin(np.outer(ids, np.arange(1, config.dim + 1)) * 0.01).astype(np.float32)
            assert fast.apply(RULES[kind], ids, grad, slots, cfg, t) == slow.apply(
                RULES[kind], ids, grad, slots, cfg, t
            )
        assert fast.statistics() == slow.statistics()
    a, b = fast.export(), slow.export()
    assert a.keys() == b.keys()
    for key in a:
        assert _bits(a[key]) == _bits(b[key]), key


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=30),
    dtype=st.sampled_from([np.int32, np.int64, np.uint64, np.float32, np.float64, np.int16]),
    data=st.data(),
)
def test_a_batchs_bags_are_taken_alike_compiled_and_in_numpy(lengths, dtype, data):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.arange(offsets[-1], dtype=np.int64).astype(dtype) * 3 + 1
    rows = np.array(data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=60)), np.int64)
    got = []
    for impl in (compiled, reference):
        out = np.full(rows.size + 1, -7, np.int64)
        taken = impl.take_bags(values.view(np.uint8), values.itemsize, offsets, rows, out)
        got.append((taken.view(dtype).tolist(), out.tolist()))
    expected = [values[j] for r in rows for j in range(offsets[r], offsets[r + 1])]
    assert got[0] == got[1] and got[0][0] == expected
    for impl in (compiled, reference):
        with pytest.raises(IndexError, match="outside the batch"):
            impl.take_bags(
                values.view(np.uint8),
                values.itemsize,
                offsets,
                np.array([-1], np.int64),
                np.empty(2, np.int64),
            )
        broken = offsets.copy()
        broken[-1] = offsets[-1] + 5  # past the values
        with pytest.raises(IndexError, match="outside its values"):
            impl.take_bags(
                values.view(np.uint8),
                values.itemsize,
                broken,
                np.array([len(lengths) - 1], np.int64),
                np.empty(2, np.int64),
            )
        with pytest.raises(ValueError, match="one longer"):
            impl.take_bags(
                values.view(np.uint8), values.itemsize, offsets, rows, np.empty(rows.size + 3, np.int64)
            )


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 40),
    width=st.integers(1, 70),
    data=st.data(),
)
def test_an_arrays_examples_are_taken_alike_compiled_and_in_numpy(n, width, data):
    src = np.arange(n * width, dtype=np.int64).astype(np.uint8).reshape(n, width)
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=60)), np.int64)
    for impl in (compiled, reference):
        out = np.zeros((rows.size, width), np.uint8)
        impl.take_fixed(src, rows, out)
        assert np.array_equal(out, src[rows])
        with pytest.raises(IndexError, match="outside the array"):
            impl.take_fixed(src, np.array([n], np.int64), np.zeros((1, width), np.uint8))


def test_a_dataset_batches_every_dtype_as_numpy_indexing_would():
    """The compiled gather behind ``batch`` gives what ``array[idx]`` gives, for any dtype
    and shape (and numpy's own indexing where it cannot: objects, views)."""
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 50, 17).astype(np.int64)
    arrays = [
        rng.standard_normal((50, 3, 2)).astype(np.float32),
        rng.integers(0, 9, 50).astype(np.int8),
        np.array([f"s{i}" for i in range(50)]),
        np.array([{"i": i} for i in range(50)], dtype=object),
        rng.standard_normal((50, 4))[:, ::2],  # not contiguous
        np.zeros((50, 0)),
        (rng.standard_normal((50, 2)) + 1j).astype(np.complex64),
    ]
    for a in arrays:
        got = take_examples(a, idx)
        assert got.dtype == a.dtype and got.shape == a[idx].shape
        assert np.array_equal(got, a[idx]) if a.dtype != object else list(got) == list(a[idx])


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=30), data=st.data())
def test_a_batchs_bag_positions_are_the_same_compiled_and_in_numpy(lengths, data):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = np.array(data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=40)), np.int64)
    got = []
    for impl in (compiled, reference):
        out = np.full(rows.size + 1, -7, np.int64)
        got.append((impl.bag_positions(offsets, rows, out).tolist(), out.tolist()))
    expected = [j for r in rows for j in range(offsets[r], offsets[r + 1])]
    assert got[0] == got[1] and got[0][0] == expected
    assert got[0][1] == np.concatenate([[0], np.cumsum([lengths[r] for r in rows])]).tolist()
    for impl in (compiled, reference):
        with pytest.raises(IndexError, match="outside the batch"):
            impl.bag_positions(offsets, np.array([len(lengths)], np.int64), np.empty(2, np.int64))


@settings(max_examples=100, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 30), st.integers(1, 5)),
    itemsize=st.sampled_from([1, 2, 4, 8, 12]),
    long_bags=st.booleans(),
    data=st.data(),
)
def test_examples_kept_by_example_are_taken_feature_by_feature_the_same_compiled_and_in_numpy(
    shape, itemsize, long_bags, data
):
    """``interleave_bags`` lays out every feature's bags example by example, and
    ``take_keyed_bags`` takes examples back feature by feature: each feature's ids are the
    ones its own ``take_bags`` gives, compiled and in numpy; bags short enough for the
    compiled kernel's one fixed copy and longer ones, up to the last item of the array."""
    n, features = shape
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    lengths = rng.integers(0, 12 if long_bags else 3, (n, features)).astype(np.int32)
    items = [
        rng.integers(0, 256, (int(lengths[:, f].sum()), itemsize), dtype=np.uint8) for f in range(features)
    ]
    feature_offsets = [
        np.concatenate([[0], np.cumsum(lengths[:, f])]).astype(np.int64) for f in range(features)
    ]
    offsets = np.concatenate([[0], np.cumsum(lengths.sum(1))]).astype(np.int64)
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), max_size=40)), np.int64)
    for impl in (compiled, reference):
        laid = np.zeros(int(offsets[-1]) * itemsize, np.uint8)
        cursor = offsets[:-1].copy()
        for f in range(features):
            impl.interleave_bags(items[f].reshape(-1), itemsize, feature_offsets[f], laid, cursor)
        np.testing.assert_array_equal(cursor, offsets[1:])
        out_offsets, starts = np.empty((features, rows.size + 1), np.int64), np.empty(features, np.int64)
        got = impl.take_keyed_bags(laid, itemsize, offsets, lengths, rows, out_offsets, starts)
        for f in range(features):
            want_offsets = np.empty(rows.size + 1, np.int64)
            want = reference.take_bags(items[f].reshape(-1), itemsize, feature_offsets[f], rows, want_offsets)
            np.testing.assert_array_equal(out_offsets[f], want_offsets)
            at = int(starts[f]) * itemsize
            np.testing.assert_array_equal(got[at : at + want.size], want)
        with pytest.raises(IndexError, match="outside the batch"):
            impl.take_keyed_bags(
                laid,
                itemsize,
                offsets,
                lengths,
                np.array([n], np.int64),
                np.empty((features, 2), np.int64),
                starts,
            )
        wrong = lengths.copy()
        wrong[0, 0] += 1
        with pytest.raises(IndexError, match="do not match its offsets"):
            impl.take_keyed_bags(
                laid,
                itemsize,
                offsets,
                wrong,
                np.array([0], np.int64),
                np.empty((features, 2), np.int64),
                starts,
            )
        with pytest.raises(IndexError, match="outside its values or out"):
            impl.interleave_bags(
                items[0].reshape(-1), itemsize, feature_offsets[0], laid, offsets[1:].copy() + 1
            )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.integers(0, 199), max_size=60),
    width=st.sampled_from([1, 8, 24, 100, 6000]),
    offset=st.sampled_from([0, 1, 4096, 12345]),
)
def test_records_read_from_a_file_are_the_same_compiled_and_in_numpy(tmp_path_factory, picks, width, offset):
    """Records read in runs, in spans over the dead records between them (the compiled
    kernel's ``pread`` path: gaps of up to 16 KiB, spans of up to 1 MiB; rows of 6,000 bytes
    cross both limits), or one by one, or through io_uring (a read a run, many in flight);
    from the file's start or from ``offset`` on (a column of a checkpoint file a restore
    linked into a tier)."""
    path = tmp_path_factory.mktemp("records") / "column"
    data = np.random.default_rng(width).integers(0, 256, (200, width), dtype=np.uint8)
    path.write_bytes(b"h" * offset + data.tobytes())
    records = np.unique(np.asarray(picks, np.int64))
    fd = os.open(path, os.O_RDONLY)
    ways = [
        functools.partial(compiled.pread_records, uring=True),
        functools.partial(compiled.pread_records, uring=False),
        reference.pread_records,
    ]
    try:
        for read in ways:
            out = np.zeros((records.size, width), np.uint8)
            assert read(fd, records, width, out, offset) == 0
            np.testing.assert_array_equal(out, data[records])
            for past in ([198, 199, 200], [197, 200]):  # a record past the file's end: a short read
                want = np.array(past, np.int64)
                assert read(fd, want, width, np.zeros((want.size, width), np.uint8), offset) == -1
            with pytest.raises(ValueError, match="offset"):
                read(fd, records, width, out, -1)
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_records_the_page_cache_holds_are_read_and_the_others_marked_missed(tmp_path):
    """``cached_records`` (what a tiered table's serving loop reads itself) reads the records
    the page cache holds, as ``pread_records`` does, and never waits for the disk: a run it
    cannot read whole (past the file's end here; not cached; a closed file) is marked in
    ``missed`` (its rows are not the file's to use), and no error is raised. Compiled, through
    io_uring and by ``preadv2``, and in numpy."""
    width = 272
    data, fd = _records_file(tmp_path, 3_000, width, 5)
    ways = [
        functools.partial(compiled.cached_records, uring=True),
        functools.partial(compiled.cached_records, uring=False),
        reference.cached_records,
    ]
    records = np.array([0, 1, 2, 40, 41, 1_000, 2_998, 2_999], np.int64)
    try:
        for read in ways:
            out = np.zeros((records.size, width), np.uint8)
            missed = np.ones(records.size, np.uint8)  # (set by each call, whatever it held)
            assert read(fd, records, width, out, missed) == records.size  # just written: cached
            assert not missed.any()
            np.testing.assert_array_equal(out, data[records])
            # runs past the file's end are missed, whole, and the others read
            past = np.array([5, 2_999, 3_000, 3_001, 4_000], np.int64)
            out = np.full((past.size, width), 7, np.uint8)
            missed = np.zeros(past.size, np.uint8)
            assert read(fd, past, width, out, missed) == 1
            np.testing.assert_array_equal(missed, [0, 1, 1, 1, 1])  # 2,999 runs on past the end
            np.testing.assert_array_equal(out[0], data[5])
            with pytest.raises(ValueError, match="missed"):
                read(fd, records, width, np.zeros((records.size, width), np.uint8), missed[:2])
            with pytest.raises(ValueError, match="out"):
                read(fd, records, width + 1, np.zeros((records.size, width), np.uint8), missed)
        # dropped from the page cache: what is read is the file's
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        out = np.full((records.size, width), 7, np.uint8)
        missed = np.zeros(records.size, np.uint8)
        got = compiled.cached_records(fd, records, width, out, missed)
        assert got == records.size - int(missed.sum())
        read_here = missed == 0
        np.testing.assert_array_equal(out[read_here], data[records[read_here]])
    finally:
        os.close(fd)
    for read in ways:  # a closed file: every record missed, no error
        missed = np.zeros(2, np.uint8)
        assert read(fd, np.array([0, 9], np.int64), width, np.zeros((2, width), np.uint8), missed) == 0
        assert missed.all()


def _records_file(tmp_path, rows: int, width: int, seed: int) -> tuple[np.ndarray, int]:
    """A file of ``rows`` random records of ``width`` bytes, and a descriptor open on it."""
    data = np.random.default_rng(seed).integers(0, 256, (rows, width), dtype=np.uint8)
    path = tmp_path / "segment"
    path.write_bytes(data.tobytes())
    return data, os.open(path, os.O_RDONLY)


@pytest.mark.timeout(60)
def test_records_read_through_io_uring_match_the_file_and_report_errors(tmp_path):
    """Over a ring's depth of separate reads at once (1,000 records, a read each), and a run
    longer than one read asks for, through io_uring where the kernel has it: the file's bytes;
    a closed file's errno, as ``pread`` gives it; and whether a ring did the reads, said by
    ``io_uring_reads`` (False only where this kernel has no io_uring to give)."""
    width = 288
    data, fd = _records_file(tmp_path, 5_000, width, 3)
    try:
        scattered = np.arange(0, 5_000, 5, dtype=np.int64)  # 1,000 runs of one record
        whole = np.arange(5_000, dtype=np.int64)  # one run
        for records in (scattered, whole):
            out = np.zeros((records.size, width), np.uint8)
            assert compiled.pread_records(fd, records, width, out) == 0
            np.testing.assert_array_equal(out, data[records])
    finally:
        os.close(fd)
    used = compiled.io_uring_reads()
    assert used is True or (used is False and not _kernel_has_io_uring())
    out = np.zeros((2, width), np.uint8)
    assert compiled.pread_records(fd, np.array([0, 9], np.int64), width, out) == errno.EBADF
    assert compiled.pread_records(fd, np.array([0, 9], np.int64), width, out, uring=False) == errno.EBADF


def _kernel_has_io_uring() -> bool:
    """Whether this kernel lets a process make an io_uring that reads (a 2-entry ring, closed
    at once, whose features say IORING_OP_READ is there: Linux 5.6's IORING_FEAT_RW_CUR_POS)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    fd = libc.syscall(425, 2, params)  # __NR_io_uring_setup on x86-64 and arm64
    if fd < 0:
        return False
    os.close(fd)
    features = int.from_bytes(params.raw[20:24], "little")  # after five other u32 fields
    return bool(features & (1 << 3))


@settings(max_examples=150, deadline=None)
@given(
    buf=st.lists(st.integers(0, 10**6), min_size=1, max_size=40),
    incoming=st.lists(st.integers(0, 10**6), max_size=120),
    data=st.data(),
)
def test_a_shuffles_steady_state_is_the_same_compiled_and_in_numpy(buf, incoming, data):
    draws = np.array(
        data.draw(
            st.lists(st.floats(0, 1, exclude_max=True), min_size=len(incoming), max_size=len(incoming))
        ),
        np.float64,
    )
    got = {}
    for name, k in (("compiled", compiled), ("numpy", reference)):
        b, out = np.array(buf, np.int64), np.empty(len(incoming), np.int64)
        k.shuffle_through(b, np.array(incoming, np.int64), draws, out)
        got[name] = (b.tolist(), out.tolist())
    assert got["compiled"] == got["numpy"]
    # each row out was in the buffer, and the buffer keeps the rest: nothing lost or repeated
    assert sorted(got["numpy"][0] + got["numpy"][1]) == sorted(buf + incoming)
    for k in (compiled, reference):
        with pytest.raises(ValueError, match="a draw outside"):
            k.shuffle_through(np.zeros(3, np.int64), np.zeros(1, np.int64), np.ones(1), np.empty(1, np.int64))


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(-3, 60), max_size=80),
    n=st.integers(0, 60),
    dtype=st.sampled_from([np.int32, np.int64]),
    sort=st.booleans(),
)
def test_checking_a_requests_rows_is_the_same_compiled_and_in_numpy(rows, n, dtype, sort):
    ids = np.array(sorted(set(rows)) if sort else rows, dtype)
    got = []
    for k in (compiled, reference):
        out = np.full(ids.size, -7, np.int64)
        got.append((k.ascending_rows(ids, n, out), out.tolist(), k.ascending_rows(ids.astype(np.int64), n)))
    assert got[0] == got[1]
    bad, ascending = got[0][0]
    inside = [i for i, r in enumerate(ids.tolist()) if not 0 <= r < n]
    assert bad == (inside[0] if inside else -1)
    seen = ids.tolist()[: bad if bad >= 0 else None]
    assert ascending == all(a < b for a, b in zip(seen, seen[1:]))
    assert got[0][1][: len(seen)] == seen


@pytest.mark.timeout(60)
def test_reads_on_many_threads_at_once_each_get_their_records_and_leave_no_ring_behind(tmp_path):
    """Eight threads reading records of one file at once (each through its own ring where
    the kernel has io_uring) each get exactly theirs; once the threads have ended, their
    rings are closed: the process holds the file descriptors it held before (within a
    deadline: the ring closes as the thread exits, after ``join`` returns)."""
    width = 128
    data, fd = _records_file(tmp_path, 4_000, width, 5)
    try:
        before = len(os.listdir("/proc/self/fd"))

        def reads(seed: int) -> bool:
            rng = np.random.default_rng(seed)
            for _ in range(40):
                records = np.unique(rng.integers(0, 4_000, 300)).astype(np.int64)
                out = np.zeros((records.size, width), np.uint8)
                if compiled.pread_records(fd, records, width, out) != 0 or not (out == data[records]).all():
                    return False
            return True

        threads = [threading.Thread(target=lambda k=k: results.append(reads(k))) for k in range(8)]
        results: list[bool] = []
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [True] * 8
        # a ring closes as its thread exits, which goes on a little past join's return
        wait_until(lambda: len(os.listdir("/proc/self/fd")) == before, 10, "the threads' rings to close")
    finally:
        os.close(fd)


@settings(max_examples=200, deadline=None)
@given(
    bits=st.integers(1, 31),
    handles=st.integers(0, 20),
    data=st.data(),
)
def test_a_tiers_places_read_back_the_same_compiled_and_in_numpy_and_as_the_tier_encodes_them(
    bits, handles, data
):
    """A tier's cold slots hold their places in 32 bits (handle, record in its run): read back
    through the compiled pass, the numpy one and the tier's own :class:`Places` indexed any
    way numpy indexes (slots, negative ones, a list, a slice), free slots as -1; a slot
    outside, or a handle never given, refused."""
    from pstrain.server.ps.tables.cold_places import Places

    top = (1 << (32 - bits)) - 1  # the handles a code may hold (the last is a free slot's)
    handles = min(handles, top)
    numbers = np.array(
        data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=handles, max_size=handles)), np.int64
    )
    firsts = np.array([h << bits for h in range(handles)], np.int64)
    records = st.integers(0, (1 << bits) - 1)
    code = (
        st.one_of(
            st.just(0xFFFFFFFF),
            st.tuples(st.integers(0, handles - 1), records).map(lambda hr: (hr[0] << bits) | hr[1]),
        )
        if handles
        else st.just(0xFFFFFFFF)
    )
    codes = np.array(data.draw(st.lists(code, min_size=1, max_size=60)), np.uint32)

    def place(c: int) -> int:
        return (
            -1
            if c == 0xFFFFFFFF
            else int(numbers[c >> bits]) << 32 | int(firsts[c >> bits]) + (c & ((1 << bits) - 1))
        )

    got = [k.decode_places(codes, bits, numbers, firsts) for k in (compiled, reference)]
    assert got[0].tolist() == got[1].tolist() == [place(c) for c in codes.tolist()]
    places = Places(1 << bits)  # the tier's own decoding, through the kernels in use
    places.bits, places.mask, places.codes, places.numbers, places.firsts = (
        bits,
        (1 << bits) - 1,
        codes,
        numbers,
        firsts,
    )
    at = np.array(data.draw(st.lists(st.integers(-codes.size, codes.size - 1), max_size=80)), np.int64)
    expect = [place(c) for c in codes[at].tolist()]
    assert places[at].tolist() == places[at.tolist()].tolist() == expect
    lo, hi = sorted(data.draw(st.tuples(st.integers(0, codes.size), st.integers(0, codes.size))))
    assert places[lo:hi].tolist() == [place(c) for c in codes[lo:hi].tolist()]
    with pytest.raises(IndexError):
        places[np.array([codes.size], np.int64)]
    for k in (compiled, reference):
        if handles < top:
            bad = np.array([handles << bits], np.uint32)
            with pytest.raises(IndexError, match="never given"):
                k.decode_places(bad, bits, numbers, firsts)
        with pytest.raises(ValueError, match="bits"):
            k.decode_places(codes, 32, numbers, firsts)


@settings(max_examples=100, deadline=None)
@given(size=st.integers(1, 64), data=st.data())
def test_bits_of_slots_are_set_and_cleared_alike_compiled_and_in_numpy(size, data):
    """``mark_bits``: bit ``s % 8`` of byte ``s // 8`` set where asked, cleared elsewhere (all
    cleared with no answers), other bits untouched; the same compiled and in numpy. A slot
    past the bits is refused, nothing written."""
    start = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), np.uint8)
    picks = st.lists(st.integers(0, 8 * size - 1), unique=True, max_size=8 * size)
    slots = np.array(data.draw(picks), np.int64)
    on = np.array(data.draw(st.lists(st.booleans(), min_size=slots.size, max_size=slots.size)), np.uint8)
    if data.draw(st.booleans()):
        on = np.empty(0, np.uint8)
    want = np.unpackbits(start, bitorder="little").astype(bool)
    want[slots] = on.astype(bool) if on.size else False
    for impl in (compiled, reference):
        bits = start.copy()
        impl.mark_bits(bits, slots, on)
        assert np.unpackbits(bits, bitorder="little").astype(bool).tolist() == want.tolist()
        with pytest.raises(IndexError, match="past the bits"):
            impl.mark_bits(bits, np.array([0, 8 * size], np.int64), np.ones(2, np.uint8))
        assert np.unpackbits(bits, bitorder="little").astype(bool).tolist() == want.tolist()
