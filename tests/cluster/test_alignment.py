"""A ps's arrays start on a cache line (64 bytes): rows of a multiple of 64 bytes are then
read and written in the fewest lines. numpy's own allocator puts large arrays 16 bytes past
a page; the ps runs in a context whose allocator (pstrain._kernels.compiled, NEP 49) does
not, and whatever it allocates through it keeps its values through growth and frees."""

from __future__ import annotations

import contextvars

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pstrain
from pstrain._kernels import KERNELS, compiled
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(120)


def _aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % 64 == 0


#: Whether this run's ps put their arrays on cache lines: the compiled kernels' allocator
#: does; the numpy reference (PSTRAIN_KERNELS=numpy) keeps numpy's own, by design.
ALIGNS = KERNELS is compiled


def _held_aligned(a: np.ndarray) -> bool:
    return _aligned(a) or not ALIGNS


def test_arrays_made_in_an_aligned_context_start_on_a_cache_line_and_only_there():
    context = contextvars.copy_context()
    context.run(compiled.aligned_allocations)
    big = context.run(np.empty, (1_000_000, 32), np.float32)
    zeros = context.run(np.zeros, (300_000, 16), np.float32)
    assert _aligned(big) and _aligned(zeros)
    assert not zeros.any()  # zero without being written
    # Outside that context numpy's allocator is as it was (16 bytes past a page here).
    assert not _aligned(np.empty((1_000_000, 32), np.float32))


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.integers(0, 200_000), st.integers(0, 400_000), st.booleans()), min_size=1, max_size=25
    )
)
def test_a_resized_array_keeps_its_values_and_its_line(steps):
    # realloc may move a block so that its data no longer starts where it did: the data moves
    # with it (small blocks from the heap, large ones by mremap).
    context = contextvars.copy_context()
    context.run(compiled.aligned_allocations)
    kept = []
    for i, (size, new, keep) in enumerate(steps):
        a = context.run(np.full, size, i % 251, np.uint8)
        a.resize(new, refcheck=False)
        assert _aligned(a)
        assert (a[: min(size, new)] == i % 251).all() and not a[size:].any()
        if keep:
            kept.append((a, i % 251, min(size, new)))
    for a, value, n in kept:  # nothing freed or moved under another's feet
        assert (a[:n] == value).all()


async def test_a_ps_holds_its_variables_slots_tables_and_restores_on_cache_lines(tmp_path):
    root = str(tmp_path)
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            given_value = pstrain.Variable(np.ones((20_000, 32), np.float32), name="given")
            made = pstrain.Variable(
                pstrain.initializers.RandomUniform(seed=1), shape=(20_000, 32), name="made"
            )
            table = pstrain.DynamicEmbedding(16, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        ids = np.arange(50_000, dtype=np.int64)  # past the table's first size: it grows
        await table.lookup(ids)
        await opt.apply_gradients(
            [
                (pstrain.IndexedSlices(np.ones((3, 32), np.float32), np.array([1, 2, 3])), given_value),
                (pstrain.IndexedSlices(np.ones((3, 32), np.float32), np.array([4, 5, 6])), made),
                (pstrain.IndexedSlices(np.ones((ids.size, 16), np.float32), ids), table),
            ]
        )
        ckpt = pstrain.Checkpoint(given=given_value, made=made, emb=table, opt=opt)
        path = await ckpt.save(f"{root}/ckpt")
        before = (await given_value.read_value()).copy()
        ps = cluster.ps[0]
        names = [r.name for r in ps.store]
        assert len(names) >= 4  # the two variables, their accumulators
        for record in ps.store:
            if record.array.ndim:
                assert _held_aligned(record.array), record.name
        emb = next(iter(ps.tables.values()))
        assert emb.rows.shape[0] >= ids.size
        assert _held_aligned(emb.rows) and emb.slots and all(_held_aligned(s) for s in emb.slots.values())
        await given_value.assign(np.zeros((20_000, 32), np.float32))
        await ckpt.restore(path)
        assert _held_aligned(ps.store.get(given_value.name).array)
        np.testing.assert_array_equal(await given_value.read_value(), before)
