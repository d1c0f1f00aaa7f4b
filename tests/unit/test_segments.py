"""pstrain.math: a batch's distinct ids (``tf.unique``) and per-id sums (``tf.math.
unsorted_segment_sum``), compiled, held to numpy's results bit for bit (property tests)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pstrain
from pstrain._kernels import batches, compiled, reference
from pstrain.errors import InvalidArgumentError
from pstrain.math import unique, unsorted_segment_sum

pytestmark = pytest.mark.timeout(120)

#: Ids from a small range (many repeats, long probe chains) or the whole 64-bit space.
IDS = st.lists(st.one_of(st.integers(-20, 60), st.integers(-(2**63), 2**63 - 1)), max_size=400)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@settings(max_examples=150, deadline=None)
@given(IDS)
def test_the_distinct_ids_are_the_same_compiled_and_in_numpy_in_first_seen_order(ids):
    x = np.array(ids, np.int64)
    fast, slow = compiled.unique_first(x), reference.unique_first(x)
    assert _bits(fast[0]) == _bits(slow[0]) and _bits(fast[1]) == _bits(slow[1])
    assert list(fast[0]) == list(dict.fromkeys(ids))  # tf.unique's order: as they first occur
    assert (fast[0][fast[1]] == x).all() and fast[1].dtype == np.int64


@settings(max_examples=200, deadline=None)
@given(IDS, st.booleans(), st.sampled_from([0, 8, 40]))
def test_the_radix_argsort_is_numpys_stable_argsort_signed_and_unsigned(ids, unsigned, shift):
    """Repeats keep their order; values sharing high bytes (``shift``: small ids, whose
    top bytes the sort skips) or spread over all 64 bits; as int64 or as uint64."""
    x = np.array(ids, np.int64) >> shift if ids else np.array([], np.int64)
    want = np.argsort(x.view(np.uint64) if unsigned else x, kind="stable")
    for impl in (compiled, reference):
        got = impl.argsort_stable(x, unsigned)
        assert got.dtype == np.int64 and got.tolist() == want.tolist(), impl.__name__


#: Ids packed tight or far apart: clusters that share their high bits beside ids far off
#: (long runs the packed sort leaves for the whole ids to order), repeats, int64's ends.
CLUSTERED = st.lists(
    st.one_of(
        st.integers(-20, 60),
        st.integers(2**62, 2**62 + 3_000),
        st.integers(-(2**63), -(2**63) + 40),
        st.just(2**63 - 1),
        st.integers(-(2**63), 2**63 - 1),
    ),
    max_size=600,
)


@settings(max_examples=250, deadline=None)
@given(st.one_of(IDS, CLUSTERED), st.booleans(), st.sampled_from([0, 8, 40]))
def test_the_packed_sort_distinct_is_np_unique_exactly_signed_and_unsigned(ids, unsigned, shift):
    """Repeats, ids sharing high bits (``shift``: small ids), clusters beside ids far off,
    spread over all 64 bits; as int64 or as uint64: np.unique's ids and positions."""
    x = np.array(ids, np.int64) >> shift if ids else np.array([], np.int64)
    want_y, want_idx = np.unique(x.view(np.uint64) if unsigned else x, return_inverse=True)
    for impl in (compiled, reference):
        y, idx = impl.unique_sorted(x, unsigned)
        assert y.dtype == idx.dtype == np.int64, impl.__name__
        assert _bits(y) == _bits(want_y), impl.__name__
        assert idx.tolist() == want_idx.reshape(-1).tolist(), impl.__name__


def test_the_packed_sort_orders_a_long_run_of_ids_sharing_their_high_bits():
    """Thousands of distinct ids within the bits the packing drops, beside one far off (so
    the packing drops bits): one long run, ordered by the whole ids, as np.unique does."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.integers(0, 1 << 13, 5_000), [2**63 - 1, -(2**63)]]).astype(np.int64)
    rng.shuffle(x)
    want_y, want_idx = np.unique(x, return_inverse=True)
    y, idx = compiled.unique_sorted(x, False)
    assert y.tolist() == want_y.tolist() and idx.tolist() == want_idx.tolist()


@settings(max_examples=200, deadline=None)
@given(st.one_of(IDS, st.lists(st.integers(-(2**63), 2**63 - 1), unique=True).map(sorted)), st.booleans())
def test_the_span_of_ids_is_their_least_greatest_and_whether_they_ascend_in_either_order(ids, unsigned):
    """Least, greatest and strictly ascending, as int64 or as uint64 (where a negative id is
    past every positive one): numpy's answers, from the compiled pass and the reference."""
    x = np.array(ids or [5], np.int64)
    as_read = x.view(np.uint64) if unsigned else x
    want = (int(as_read.min()), int(as_read.max()), bool(np.all(as_read[1:] > as_read[:-1])))
    for impl in (compiled, reference):
        assert impl.id_span(x, unsigned) == want, impl.__name__
        with pytest.raises(ValueError, match="no ids"):
            impl.id_span(np.array([], np.int64), unsigned)


@settings(max_examples=200, deadline=None)
@given(
    offsets=st.lists(st.integers(0, 700), max_size=300),
    low=st.sampled_from([0, -5, 63, 2**40, -(2**63)]),
    extra=st.integers(0, 130),
)
def test_the_bitmap_distinct_is_np_unique_exactly_at_any_low_and_word_edge(offsets, low, extra):
    """Ids marked in a span's bits: the ids ascending and their positions are np.unique's,
    whatever the span's start (negative, past 32 bits, int64's lowest) and its last word."""
    x = np.array([low + o for o in offsets], np.int64)
    span = (max(offsets) + 1 if offsets else 1) + extra
    want_y, want_idx = np.unique(x, return_inverse=True)
    for impl in (compiled, reference):
        y, idx = impl.unique_in_span(x, low, span)
        assert y.dtype == idx.dtype == np.int64, impl.__name__
        assert y.tolist() == want_y.tolist() and idx.tolist() == want_idx.reshape(-1).tolist(), impl.__name__


def test_the_bitmap_distinct_refuses_an_id_outside_its_span_or_a_span_too_large():
    for impl in (compiled, reference):
        # past the span's end; below its start; past it by more than int64 holds
        for ids, low in (([3, 10], 3), ([2, 5], 3), ([-(2**63), 2**62], -(2**63))):
            with pytest.raises(IndexError, match="outside the span"):
                impl.unique_in_span(np.array(ids, np.int64), low, 7)
        for span in (0, 2**41):
            with pytest.raises(ValueError, match="span must be"):
                impl.unique_in_span(np.array([1], np.int64), 0, span)


@settings(max_examples=150, deadline=None)
@given(
    IDS,
    st.sampled_from([np.int64, np.int32, np.uint64, np.uint8, np.dtype(">u8"), np.dtype(">i8")]),
    st.booleans(),
)
def test_unique_sorted_is_np_unique_exactly_and_unsorted_keeps_first_occurrence(ids, dtype, packed):
    """Any integer dtype, big-endian ones too (read in their own order: a big-endian
    uint64 past 2**63 is not a negative int64), sorted either way ``distinct`` may sort
    (``PACKED_SORT``: which one depends on the CPU)."""
    x = np.array([i % 256 if dtype == np.uint8 else i for i in ids]).astype(dtype)
    want_y, want_idx = np.unique(x, return_inverse=True)
    with mock.patch.object(batches, "PACKED_SORT", packed):
        y, idx = unique(x, sorted=True)
    assert y.dtype == x.dtype and _bits(y) == _bits(want_y) and (idx == want_idx).all()
    y, idx = unique(x)
    assert list(y) == list(dict.fromkeys(x.tolist())) and (y[idx] == x).all()


@settings(max_examples=150, deadline=None)
@given(
    n_segments=st.integers(0, 30),
    dim=st.integers(0, 5),
    ids=st.lists(st.integers(-3, 29), max_size=200),
    double=st.booleans(),
)
def test_segment_sums_are_np_add_at_bit_for_bit_compiled_and_in_numpy(n_segments, dim, ids, double):
    seg = np.array([i for i in ids if i < n_segments], np.int64)
    dtype = np.float64 if double else np.float32
    data = np.random.default_rng(len(ids)).standard_normal((seg.size, dim)).astype(dtype)
    want = np.zeros((n_segments, dim), dtype)
    np.add.at(want, seg[seg >= 0], data[seg >= 0])  # a negative id drops its row (as TF)
    for impl in (compiled, reference):
        out = np.zeros((n_segments, dim), dtype)
        impl.put_rows(out, seg, data, True)
        assert _bits(out) == _bits(want), impl.__name__
    got = unsorted_segment_sum(data, seg, n_segments)
    assert got.dtype == dtype and _bits(got) == _bits(want)


def test_segment_ids_may_be_any_prefix_of_datas_shape_and_any_dtype_sums():
    data = np.arange(24).reshape(2, 3, 4)
    out = unsorted_segment_sum(data, [[0, 2, 0], [1, 1, -1]], 3)
    assert out.shape == (3, 4) and out.dtype == data.dtype
    assert (out == [data[0, 0] + data[0, 2], data[1, 0] + data[1, 1], data[0, 1]]).all()
    assert (unsorted_segment_sum(np.ones(5, np.float32), np.zeros(5, np.int8), 2) == [5, 0]).all()
    x = np.array(["b", "a", "b"])
    assert unique(x)[0].tolist() == ["b", "a"] and unique(x, sorted=True)[1].tolist() == [1, 0, 1]


def test_bad_input_is_refused_naming_what_is_wrong():
    with pytest.raises(InvalidArgumentError, match=r"segment_ids\[1\] = 5 is not below num_segments \(2\)"):
        unsorted_segment_sum(np.ones((3, 2)), [0, 5, 1], 2)
    with pytest.raises(InvalidArgumentError, match="segment_ids must be integers, got float64"):
        unsorted_segment_sum(np.ones(3), [0.0, 1.0, 1.0], 2)
    with pytest.raises(InvalidArgumentError, match=r"shape \(2,\) is not a prefix of data's \(3, 2\)"):
        unsorted_segment_sum(np.ones((3, 2)), [0, 1], 2)
    with pytest.raises(InvalidArgumentError, match="num_segments must be an integer >= 0, got -1"):
        unsorted_segment_sum(np.ones(1), [0], -1)
    with pytest.raises(InvalidArgumentError, match=r"x must be 1-D, got shape \(2, 2\)"):
        unique(np.ones((2, 2), np.int64))
    for impl in (compiled, reference):  # the kernels' own guard, under the public checks
        out = np.zeros((2, 1), np.float32)
        with pytest.raises(IndexError, match="past the array's end"):
            impl.put_rows(out, np.array([2], np.int64), np.ones((1, 1), np.float32), True)
        assert not out.any()


def test_the_public_module_is_the_documented_one():
    assert pstrain.math.unique is unique and "math" in pstrain.__all__
    assert pstrain.math.__all__ == ["unique", "unsorted_segment_sum"]


def test_unique_takes_tfs_out_idx_and_name():
    """``tf.unique(x, out_idx=tf.int64, name=...)`` ports as written (a TypeError before)."""
    y, idx = unique(np.array([7, 3, 7]), out_idx=np.int32, name="u")
    assert y.tolist() == [7, 3] and idx.tolist() == [0, 1, 0] and idx.dtype == np.int32
    assert unique(np.array([7, 3, 7]), "int64")[1].dtype == np.int64
    with pytest.raises(InvalidArgumentError, match="out_idx must be int32 or int64"):
        unique(np.array([1]), out_idx=np.float32)
    assert unsorted_segment_sum(np.ones(3), [0, 0, 1], 2, name="s").tolist() == [2.0, 1.0]
