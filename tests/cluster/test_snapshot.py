"""A save while training goes on: the file holds the table as the save began, and the ps
copies only the rows updated meanwhile, never the whole table."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import load_file

import pstrain
from pstrain._formats.files import direct_writes
from pstrain._formats.files.direct_writes import ALIGN
from pstrain._formats.files.tensor_files import whole, write_streaming
from pstrain.server.ps.checkpoints.snapshots import ChangedRows, KeptRows, Snapshot
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 2_000_000, 8  # 64 MB of float32


async def test_a_save_during_updates_writes_the_table_as_it_began_without_copying_it(tmp_path):
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            table = pstrain.Variable(
                pstrain.initializers.RandomUniform(-1, 1, seed=3), shape=(ROWS, DIM), name="big"
            )
        nbytes = ROWS * DIM * 4
        rng = np.random.default_rng(0)
        before = await table.numpy()
        batches = [np.unique(rng.integers(0, ROWS, 3000)) for _ in range(60)]
        ckpt = pstrain.Checkpoint(table=table)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()

            async def train():
                for rows in batches:  # rows spread over the whole table, as a hashed table's are
                    await table.scatter_add(
                        pstrain.IndexedSlices(np.ones((rows.size, DIM), np.float32), rows)
                    )

            path, _ = await asyncio.gather(ckpt.save(str(tmp_path / "c")), train())
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        saved = pstrain.checkpoint.load_variables(path)["table"]
        # Exactly the table as the save began: after the first k updates, none of the others.
        expected, states = before.copy(), []
        for rows in batches:
            states.append(expected.copy() if len(states) < 8 else None)
            expected[rows] += 1
        k = next((i for i, st in enumerate(states) if st is not None and np.array_equal(saved, st)), None)
        assert k is not None, "the file is no state the table was in"
        assert k < len(batches) - 1  # the save began while updates were still to come
        np.testing.assert_array_equal(await table.numpy(), expected)
        # What the save added: a block in flight and the rows updated during it, not a copy.
        assert peak < 0.5 * nbytes, f"peak {peak / 2**20:.0f} MiB for a {nbytes / 2**20:.0f} MiB table"


@contextlib.contextmanager
def _updates_meanwhile(rng: np.random.Generator, rows: int, update) -> Iterator[None]:
    """A thread doing what the serving loop does while the block runs (and at least 200
    times): ``update`` 300 random rows, repeats in any order, or unique and ascending as a
    sparse step's."""
    done = threading.Event()

    def serve() -> None:
        k = 0
        while not done.is_set() or k < 200:
            changed = rng.integers(0, rows, 300)
            update(np.unique(changed) if k % 2 else changed)
            k += 1

    server = threading.Thread(target=serve)
    server.start()
    try:
        yield
    finally:
        done.set()
        server.join(timeout=60)
    assert not server.is_alive()


@pytest.mark.parametrize("changed", [3, 400])
def test_a_snapshots_blocks_hold_the_old_rows_and_free_them_once_written(changed):

    a = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    original = a.copy()
    snap = Snapshot(a, block_rows=100)
    rows = np.random.default_rng(changed).choice(1000, changed, replace=False)
    snap.before_write(rows)
    a[rows] = -1
    blocks = snap.blocks()
    first = next(blocks)
    snap.before_write(np.arange(1000))  # everything changes after the first block was taken
    a[:] = -2
    data = np.concatenate([first, *blocks])
    np.testing.assert_array_equal(data, original)
    assert snap.kept_bytes == 0  # the kept rows were dropped once written


def test_a_snapshot_of_some_rows_gives_them_as_they_were_while_they_change():
    """A delta's changed rows, gathered block by block while updates go on."""
    a = np.arange(40.0).reshape(20, 2)
    select = np.array([1, 4, 5, 9, 17])
    want = a[select].copy()
    snap = Snapshot(a, block_rows=2, rows=select)
    blocks = snap.blocks()
    first = next(blocks)  # rows 1 and 4 are copied
    snap.before_write(np.array([3, 4, 5, 17]))  # the serving loop, before an update
    a[[3, 4, 5, 17]] = -1.0
    rest = list(blocks)
    np.testing.assert_array_equal(np.concatenate([first, *rest]), want)
    assert snap.kept_bytes == 0  # rows 5 and 17 kept (not 3: not selected; not 4: copied), then freed


@pytest.mark.parametrize("how", ["blocks", "file", "file, misaligned"])
@pytest.mark.parametrize("select", [False, True])
def test_a_snapshot_copied_while_another_thread_changes_its_rows_is_the_array_as_it_began(
    select, how, tmp_path, monkeypatch
):
    # The writer copies each block without the snapshot's lock (the serving loop's updates
    # never wait for a copy): rows changed during a copy must come back as they were. Into
    # a file, blocks are gathered straight into the writer's buffer (a small one here, so
    # rows of 7 floats fall across its end), or copied first where a 3-byte tensor before
    # them leaves them misaligned.
    monkeypatch.setattr(direct_writes, "CHUNK", 16 * ALIGN)
    rng = np.random.default_rng(7)
    array = rng.standard_normal((40_000, 7 if how.startswith("file") else 64)).astype(np.float32)
    before = array.copy()
    rows = np.unique(rng.integers(0, array.shape[0], 15_000)) if select else None
    snap = Snapshot(array, block_rows=2048, rows=rows)

    def update(changed: np.ndarray) -> None:  # the serving loop: keep the old values, change
        snap.before_write(changed)
        array[changed] += 1.0

    with _updates_meanwhile(rng, array.shape[0], update):
        if how.startswith("file"):
            in_place = []
            wrote = direct_writes.DirectWriter.wrote
            monkeypatch.setattr(
                direct_writes.DirectWriter, "wrote", lambda self, n: in_place.append(n) or wrote(self, n)
            )
            path = str(tmp_path / "s.safetensors")
            write_streaming(
                path,
                [
                    whole("flags", np.ones(3 if "misaligned" in how else 8, bool)),
                    (
                        "rows",
                        array.dtype,
                        (snap.select.size if select else array.shape[0], array.shape[1]),
                        snap,
                    ),
                ],
            )
            got = load_file(path)["rows"]
            assert bool(in_place) == ("misaligned" not in how)  # gathered in place where it can
        else:
            got = np.concatenate(list(snap.blocks()))
    assert not np.array_equal(array, before)  # the rows did change while it was copied
    np.testing.assert_array_equal(got, before if rows is None else before[rows])


@pytest.mark.parametrize("how", ["blocks", "file"])
def test_the_rows_a_delta_finds_on_its_thread_are_those_changed_by_its_mark_as_they_were(how, tmp_path):
    # A delta's rows are found by the writer, while the serving loop goes on updating and
    # stamping rows: those changed after the mark are still written, as they were at it.
    rng = np.random.default_rng(11)
    array = rng.standard_normal((40_000, 8)).astype(np.float32)
    since, mark = 2, 4
    epochs = rng.integers(0, mark + 1, array.shape[0]).astype(np.uint32)  # none after the mark
    rows = np.flatnonzero((epochs > since) & (epochs <= mark))
    want = array[rows].copy()
    snap = ChangedRows(array, epochs, since, mark, block_rows=1024)

    def update(changed: np.ndarray) -> None:  # the serving loop: keep, change, stamp
        snap.before_write(changed)
        array[changed] += 1.0
        epochs[changed] = mark + 1

    early = rows[::97]
    update(early)  # before the writer looks: no longer stamped in the range, but kept
    with _updates_meanwhile(rng, array.shape[0], update):
        found = snap.prepare()
        if how == "file":
            path = str(tmp_path / "d.safetensors")
            write_streaming(path, lambda: [("rows", array.dtype, (found.size, 8), snap)])
            got = load_file(path)["rows"]
        else:
            got = np.concatenate(list(snap.blocks()))
    np.testing.assert_array_equal(found, rows)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(array[rows], want)  # they did change while it was written
    assert snap.kept_bytes == 0


def test_a_delta_whose_every_row_is_written_meanwhile_keeps_them_once():
    a = np.arange(20.0).reshape(10, 2)
    epochs = np.array([0, 3, 3, 1, 3, 0, 0, 2, 3, 0], np.uint32)  # since 1, mark 3: 1, 2, 4, 7, 8
    snap = ChangedRows(a, epochs, since=1, mark=3)
    want = a[[1, 2, 4, 7, 8]].copy()
    snap.before_write(None)  # an assignment of the whole array: no row stamps move
    a[:] = -1.0
    kept = snap.kept_bytes
    snap.before_write(np.array([1, 2]))
    assert snap.kept_bytes == kept == want.nbytes  # kept once, not again
    assert snap.prepare().tolist() == [1, 2, 4, 7, 8]
    np.testing.assert_array_equal(np.concatenate(list(snap.blocks())), want)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 3000)), st.tuples(st.just("drop"), st.integers(0, 5000))
        ),
        max_size=30,
    )
)
def test_kept_rows_give_back_each_rows_old_values_until_dropped(ops):
    """A log of kept rows against a dict: each row's values as they were when kept, the
    rows in any range, and the memory given back as rows are dropped."""
    rng = np.random.default_rng(len(ops))
    a = rng.random((5000, 3)).astype(np.float32)
    kept, model = KeptRows(a), {}
    fresh = rng.permutation(5000)  # each row kept at most once
    used = 0
    for op, n in ops:
        if op == "add":
            rows = fresh[used : used + n]
            used += rows.size
            kept.add(rows)
            model.update({int(r): a[r].copy() for r in rows})
            a[rows] = -1.0  # changed after they were kept
        else:
            kept.drop_below(n)
            model = {r: v for r, v in model.items() if r >= n}
        assert kept.nbytes == len(model) * a[:1].nbytes
        lo, hi = sorted(rng.integers(0, 5001, 2))
        r, v = kept.between(lo, hi)
        want = sorted(k for k in model if lo <= k < hi)
        assert sorted(r.tolist()) == want
        expected = np.array([model[row] for row in r.tolist()], np.float32).reshape(-1, a.shape[1])
        np.testing.assert_array_equal(v, expected)  # each row's values, in one comparison
