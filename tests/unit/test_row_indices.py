"""A sliced dataset's index steps (``from_tensor_slices`` then shard, shuffle, repeat, take,
batch), which move row indices in blocks, against the same steps element by element (a
``from_generator`` dataset of the same numbers): the same rows in the same order, seeded
shuffles included (property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain._training import row_indices
from pstrain.data import Dataset

pytestmark = pytest.mark.timeout(120)

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("shard"), st.integers(1, 5), st.integers(0, 4)),
        st.tuples(st.just("shuffle"), st.integers(1, 5000), st.integers(0, 3)),
        st.tuples(st.just("repeat"), st.integers(-1, 3), st.just(0)),
        st.tuples(st.just("take"), st.integers(-1, 9000), st.just(0)),
    ),
    max_size=4,
)


def built(ds: Dataset, steps: list[tuple[str, int, int]]) -> Dataset:
    for op, a, b in steps:
        if op == "shard":
            ds = ds.shard(a, b % a)
        elif op == "shuffle":
            ds = ds.shuffle(a, seed=b)
        elif op == "repeat":
            ds = ds.repeat(a if a >= 0 else None).take(20000)  # forever: cut short
        else:
            ds = ds.take(a)
    return ds


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 9000), steps=STEPS, batch=st.integers(1, 3000), drop=st.booleans())
def test_index_steps_in_blocks_give_the_rows_element_steps_give(n, steps, batch, drop):
    sliced = built(Dataset.from_tensor_slices(np.arange(n, dtype=np.int64)), steps)
    elements = built(Dataset.from_generator(lambda: iter(range(n))), steps)
    assert [int(x) for x in sliced] == [int(x) for x in elements]
    got = [b.tolist() for b in sliced.batch(batch, drop_remainder=drop)]
    want = [np.asarray(b).tolist() for b in elements.batch(batch, drop_remainder=drop)]
    assert got == want


def test_blocks_cross_batches_and_shards_whatever_their_sizes(monkeypatch):
    """Blocks smaller than a batch, batches that end inside a block, shards that start in one."""
    monkeypatch.setattr(row_indices, "BLOCK", 7)
    sliced = Dataset.from_tensor_slices(np.arange(100)).shard(3, 2).shuffle(10, seed=5).batch(4)
    elements = Dataset.from_generator(lambda: iter(range(100))).shard(3, 2).shuffle(10, seed=5).batch(4)
    assert [b.tolist() for b in sliced] == [np.asarray(b).tolist() for b in elements]
    assert sorted(int(x) for x in Dataset.from_tensor_slices(np.arange(100)).shard(3, 2).shuffle(10)) == list(
        range(2, 100, 3)
    )
