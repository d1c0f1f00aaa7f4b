"""A base and its deltas, planned from their ids and read a piece at a time
(``delta_files.read_table_plan``), against applying them one by one as a restore once did:
the same ids, rows and slots, in the same order."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain._base.errors import InvalidArgumentError
from pstrain._formats.files.delta_files import read_table_plan
from pstrain._formats.files.tensor_files import write_tensors
from pstrain._formats.numerics.idhash import in_slices

pytestmark = pytest.mark.timeout(120)

DIM = 2


def one_by_one(puts, removals, slot_init):
    """Each delta applied in turn: its removed ids and re-put ids dropped, its rows appended."""
    ids, rows, slots = puts[0][0], puts[0][1], dict(puts[0][2])
    for (d_ids, d_rows, d_slots), removed in zip(puts[1:], removals[1:]):
        keep = ~np.isin(ids, np.concatenate([removed, d_ids]))
        for key in set(slots) | set(d_slots):
            old = slots.get(key, np.full(rows.shape, slot_init[key], np.float32))
            new = d_slots.get(key, np.full(d_rows.shape, slot_init[key], np.float32))
            slots[key] = np.concatenate([old[keep], new])
        ids = np.concatenate([ids[keep], d_ids])
        rows = np.concatenate([rows[keep], d_rows])
    return ids, rows, slots


def _table_file(path, ids: list[int], stamp: float, prefix: str = "") -> str:
    ids_arr = np.asarray(ids, np.int64)
    rows = np.full((ids_arr.size, DIM), stamp, np.float32)
    init = np.full(1, 0.1, np.float32)
    tensors = {f"{prefix}ids": ids_arr, f"{prefix}rows": rows, f"{prefix}slot:acc": rows + 0.5}
    write_tensors(str(path), {**tensors, f"{prefix}init:acc": init})
    return str(path)


def test_a_streamed_restore_refuses_an_id_its_base_holds_twice_and_composes_the_rest(tmp_path):
    """The plan of a streamed (tiered) restore: ids the deltas put again are the deltas',
    not repeats; an id in two files of the base, or twice in one, is refused."""
    dtype = np.dtype(np.float32)
    one = _table_file(tmp_path / "a", [1, 2, 3], 1.0)
    other = _table_file(tmp_path / "b", [4, 5], 1.0)
    delta = [(_table_file(tmp_path / "d", [2, 5, 9], 2.0, "d0:"), "d0:")]
    plan = read_table_plan([one, other], [delta], 0, 1, DIM, dtype)
    got = {
        int(i): (float(r[0]), float(s["acc"][k][0]))
        for ids, rows, s in plan.pieces()
        for k, (i, r) in enumerate(zip(ids, rows))
    }
    assert got == {1: (1.0, 1.5), 3: (1.0, 1.5), 4: (1.0, 1.5), 2: (2.0, 2.5), 5: (2.0, 2.5), 9: (2.0, 2.5)}
    twice = _table_file(tmp_path / "c", [7, 3], 1.0)  # 3 is in ``one`` too
    with pytest.raises(InvalidArgumentError, match="appears twice"):
        read_table_plan([one, twice], [delta], 0, 1, DIM, dtype)
    within = _table_file(tmp_path / "e", [6, 8, 6], 1.0)
    with pytest.raises(InvalidArgumentError, match="appears twice"):
        read_table_plan([within], [], 0, 1, DIM, dtype)


@settings(max_examples=100, deadline=None)
@given(
    base=st.lists(st.integers(0, 60), max_size=40),
    deltas=st.lists(
        st.tuples(  # each delta from one or two ps: ids put (split between them), removed
            st.lists(st.integers(0, 60), max_size=20),
            st.lists(st.integers(0, 60), max_size=8),
            st.booleans(),  # its files hold the slot
            st.booleans(),  # written by two ps
        ),
        max_size=8,
    ),
    shard=st.sampled_from([(0, 1), (0, 2), (1, 2)]),
)
def test_a_planned_restore_reads_what_applying_each_delta_in_turn_leaves(base, deltas, shard):
    """The plan reads no row until asked, and each file's kept rows by a mask: whole
    (:meth:`read_whole`), it gives what applying the deltas one by one to the base gives,
    in the same order; as pieces, the same rows, the last delta's first."""
    with tempfile.TemporaryDirectory() as tmp:
        dtype = np.dtype(np.float32)
        base_ids = sorted(set(base))
        base_file = _table_file(f"{tmp}/base", base_ids, 1.0)
        mine = _shard(base_ids, shard)
        base_rows = np.full((len(base_ids), DIM), 1.0, np.float32)
        puts = [(np.asarray(base_ids, np.int64)[mine], base_rows[mine], {"acc": base_rows[mine] + 0.5})]
        removals = [np.empty(0, np.int64)]
        chain = []
        with_acc = bool(mine.any())  # (a slot comes from a file with rows of the shard)
        for k, (put, removed, with_slot, two) in enumerate(deltas, 1):
            put = sorted(set(put))
            halves = [put[::2], put[1::2]] if two else [put]
            files, parts = [], []
            for h, ids in enumerate(halves):
                prefix = f"d{k}:"
                ids_arr = np.asarray(ids, np.int64)
                rows = np.full((ids_arr.size, DIM), k * 10 + h, np.float32)
                tensors = {f"{prefix}ids": ids_arr, f"{prefix}rows": rows}
                if with_slot:
                    tensors[f"{prefix}slot:acc"] = rows + 0.5
                    tensors[f"{prefix}init:acc"] = np.full(1, 0.1, np.float32)
                if h == 0:
                    tensors[f"{prefix}removed"] = np.asarray(sorted(set(removed)), np.int64)
                write_tensors(f"{tmp}/d{k}-{h}", tensors)
                files.append((f"{tmp}/d{k}-{h}", prefix))
                keep = _shard(ids, shard)
                parts.append((ids_arr[keep], rows[keep]))
                with_acc |= with_slot and bool(keep.any())
            chain.append(files)
            d_ids = np.concatenate([p[0] for p in parts])
            d_rows = np.concatenate([p[1] for p in parts])
            puts.append((d_ids, d_rows, {"acc": d_rows + 0.5} if with_slot else {}))
            gone = np.asarray(sorted(set(removed)), np.int64)
            removals.append(gone[_shard(gone, shard)])
        want_ids, want_rows, want_slots = one_by_one(puts, removals, {"acc": 0.1})
        plan = read_table_plan([base_file], chain, shard[0], shard[1], DIM, dtype)
        ids, rows, slots, init = plan.read_whole()
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(rows, want_rows)
        assert init == {"acc": float(np.float32(0.1))}
        assert set(slots) == ({"acc"} if with_acc else set())
        if with_acc:
            np.testing.assert_array_equal(slots["acc"], want_slots["acc"])
        pieces = list(plan.pieces(piece_bytes=3 * DIM * 4))  # (three rows a piece)
        got = np.concatenate([np.empty(0, np.int64), *(p[0] for p in pieces)])
        assert sorted(got.tolist()) == sorted(want_ids.tolist())
        by_id = {int(i): r for p in pieces for i, r in zip(p[0], p[1])}
        for i, r in zip(want_ids, want_rows):
            np.testing.assert_array_equal(by_id[int(i)], r)
        if with_acc:
            acc = {int(i): a for p in pieces for i, a in zip(p[0], p[2]["acc"])}
            for i, a in zip(want_ids, want_slots["acc"]):
                np.testing.assert_array_equal(acc[int(i)], a)
        changed = want_ids[want_rows[:, 0] >= 10]  # (the deltas' rows)
        assert plan.delta_rows == changed.size
        assert sorted(got[: changed.size].tolist()) == sorted(changed.tolist())
        last = [int(i) for i in got[: changed.size] if by_id[int(i)][0] >= 10 * len(deltas)]
        assert last == [int(i) for i in got[: len(last)]]  # (the last delta's first)


def _shard(ids, shard) -> np.ndarray:
    return in_slices(np.asarray(ids, np.int64), shard[1], shard[0])


def test_a_file_whose_rows_do_not_match_its_ids_is_refused_by_name_before_any_row_is_read(tmp_path):
    dtype = np.dtype(np.float32)
    base = _table_file(tmp_path / "a", [1, 2, 3], 1.0)
    short = str(tmp_path / "d")
    write_tensors(short, {"d1:ids": np.arange(4, dtype=np.int64), "d1:rows": np.ones((3, DIM), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"rows in .*/d d1: is \(3, 2\), expected \(4, 2\)"):
        read_table_plan([base], [[(short, "d1:")]], 0, 1, DIM, dtype)
    slot = str(tmp_path / "b")
    write_tensors(
        slot,
        {
            "ids": np.arange(2, dtype=np.int64),
            "rows": np.ones((2, DIM), np.float32),
            "slot:acc": np.ones((2, DIM + 1), np.float32),
            "init:acc": np.full(1, 0.1, np.float32),
        },
    )
    with pytest.raises(InvalidArgumentError, match=r"slot:acc in .*/b is \(2, 3\), expected \(2, 2\)"):
        read_table_plan([slot], [], 0, 1, DIM, dtype)


def test_composing_a_chain_holds_the_ids_it_touches_not_every_id_it_names():
    """Fifty deltas that each put the same 4,000 ids: the set of ids they touched is sized
    for 4,000 ids (as for one delta), not for the 200,000 they name; the last delta keeps
    them all and every earlier one none."""
    from pstrain._formats.files.delta_files import kept_by_later

    ids = np.arange(4000, dtype=np.int64) * 7919
    keeps, seen = kept_by_later([ids] * 50, [np.empty(0, np.int64)] * 50)
    assert len(seen) == 4000 and seen.nbytes <= 4 * 16 * 4000
    assert keeps[-1].all() and not any(k.any() for k in keeps[:-1])
    bounded, _ = kept_by_later([ids] * 50, [np.empty(0, np.int64)] * 50, at_most=10**6)
    assert all((a == b).all() for a, b in zip(bounded, keeps))
