"""Which rows of a large variable changed since a mark: what delta checkpoints and slice
moves read. Updates flag their rows (a bit a row) and the flags become epochs lazily; these
tests hold that to a model that stamps every row's epoch as it changes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain.server.ps.store import SNAPSHOT_MIN_BYTES, ChangeClock, VariableRecord

pytestmark = pytest.mark.timeout(120)

ROWS = SNAPSHOT_MIN_BYTES // 8 + 3  # two float32 columns: over the size that stamps rows


def _record() -> tuple[VariableRecord, ChangeClock]:
    clock = ChangeClock()
    record = VariableRecord("v", np.zeros((ROWS, 2), np.float32), True)
    record.track(clock)
    assert record.row_epochs is not None
    return record, clock


_rows = st.lists(st.integers(0, 15), min_size=1, max_size=8).map(
    lambda r: np.unique(np.array(r, np.int64) * 997 % ROWS)
)
_KINDS = ["update", "mark", "check", "update", "unsorted", "save", "end", "full", "mark", "update"]
_ops = st.lists(st.tuples(st.sampled_from(_KINDS), _rows, st.integers(0, 5)), min_size=3, max_size=30)


@settings(max_examples=200, deadline=None, database=None)
@given(ops=_ops)
def test_the_rows_changed_since_each_mark_are_those_a_stamp_per_update_gives(ops):
    """Updates (sorted rows, and rows as numpy indexes them), marks, and saves (deltas and
    full ones) that begin and end while updates go on: whenever asked (asking stamps the
    flags, so not after every step), the rows changed since every mark taken are the
    model's, and each delta finds exactly its rows, with their values at its mark."""
    record, clock = _record()
    model = np.zeros(ROWS, np.int64)  # each row's epoch, stamped as it changes
    marks = [0]
    saves: list[tuple[object, np.ndarray, np.ndarray]] = []  # (snapshot, its rows, values)
    full: list[object] = []
    for i, (op, arg, k) in enumerate(ops):
        if op in ("update", "unsorted"):
            rows = arg if op == "update" else arg[::-1].copy().astype(np.int32)
            arr = record.writable(rows)
            arr[np.asarray(rows, np.int64)] += i + 1
            model[np.asarray(rows, np.int64)] = clock.epoch
        elif op == "mark":
            marks.append(clock.mark())
        elif op == "save":
            since = marks[k % len(marks)]
            mark = clock.mark()
            marks.append(mark)
            snap = record.changes_snapshot(since, mark)
            assert snap is not None
            want = np.flatnonzero((model > since) & (model <= mark))
            saves.append((snap, want, record.array[want].copy()))
        elif op == "full":  # a full save's snapshot, which reads no epochs
            full.append(record.snapshot())
            if len(full) > 1:
                record.end_snapshot(full.pop(0))
        elif op == "end" and saves:  # the oldest delta is written, then ends
            snap, want, values = saves.pop(0)
            assert snap.prepare().tolist() == want.tolist()
            got = np.concatenate([*snap.blocks(), np.zeros((0, 2), np.float32)])
            np.testing.assert_array_equal(got, values)
            record.end_snapshot(snap)
        elif op == "check":
            for since in marks:
                assert record.changed_rows(since).tolist() == np.flatnonzero(model > since).tolist()
    for snap, want, values in saves:
        assert snap.prepare().tolist() == want.tolist()
        np.testing.assert_array_equal(np.concatenate([*snap.blocks(), np.zeros((0, 2), np.float32)]), values)
    for since in marks:
        assert record.changed_rows(since).tolist() == np.flatnonzero(model > since).tolist()


def test_an_update_after_a_mark_does_not_move_the_rows_flagged_before_it_past_the_mark():
    """Rows flagged in one epoch and stamped only when the next epoch's update comes are
    stamped with the epoch they changed in, not the one the stamp happens in."""
    record, clock = _record()
    record.writable(np.array([1, 5], np.int64))
    first = clock.mark()
    record.writable(np.array([5, 9], np.int64))
    second = clock.mark()
    assert record.changed_rows(0).tolist() == [1, 5, 9]
    assert record.changed_rows(first).tolist() == [5, 9]
    assert record.changed_rows(second).tolist() == []
    assert record.row_epochs is not None and record.row_epochs[[1, 5, 9]].tolist() == [1, 2, 2]


def test_a_save_begun_between_updates_finds_the_rows_flagged_before_it_as_they_were():
    """Rows flagged before a delta's mark, then changed again while the save is written:
    the save finds them, with their values at the mark."""
    record, clock = _record()
    record.writable(np.array([2, 7], np.int64))[[2, 7]] = 1.0
    mark = clock.mark()
    snap = record.changes_snapshot(0, mark)
    assert snap is not None
    record.writable(np.array([7, 8], np.int64))[[7, 8]] = 2.0  # while the save goes on
    record.writable(np.array([7], np.int64))[7] = 3.0  # and again
    assert snap.prepare().tolist() == [2, 7]
    np.testing.assert_array_equal(np.concatenate(list(snap.blocks())), np.ones((2, 2), np.float32))
    record.end_snapshot(snap)
    assert record.changed_rows(mark).tolist() == [7, 8]


def test_rows_flagged_before_a_full_save_began_keep_the_epoch_of_a_later_change():
    """Rows flagged, then a full save's snapshot (which reads no epochs) and a mark, then
    the same rows changed while it is written: they are stamped with the later epoch."""
    record, clock = _record()
    record.writable(np.array([3], np.int64))
    snap = record.snapshot()
    assert snap is not None
    mark = clock.mark()
    record.writable(np.array([3], np.int64))
    record.end_snapshot(snap)
    assert record.changed_rows(mark).tolist() == [3]
