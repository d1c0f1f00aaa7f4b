"""The bookkeeping a tiered shard keeps in RAM for each row on disk (:class:`ColdRows`):
12 bytes a row besides its index entry (a place in 32 bits), what the budget reckons of it, slots
given up and taken again, places never given twice, eviction keys past 32 bits."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain._kernels import KERNELS
from pstrain._kernels.id_index import PartitionedIndex
from pstrain.server.ps.tables.cold_records import META
from pstrain.server.ps.tables.cold_rows import KEY_SPAN, ColdRows
from pstrain.server.ps.tables.cold_segments import removals_done

pytestmark = pytest.mark.timeout(120)


def store(tmp_path, segment_rows: int = 64) -> ColdRows:
    return ColdRows(
        str(tmp_path / f"c{len(list(tmp_path.iterdir()))}"),
        2,
        np.dtype(np.float32),
        segment_rows=segment_rows,
    )


def put(cold: ColdRows, ids: np.ndarray, keys: np.ndarray | None = None) -> None:
    rows = np.stack([ids, -ids], axis=1).astype(np.float32)
    keys = np.zeros(ids.size, np.int64) if keys is None else keys
    cold.put(ids, rows, {}, np.zeros(ids.size, META), keys)


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), st.integers(1, 200)), min_size=1, max_size=30))
def test_what_a_put_will_take_is_what_it_takes_and_every_row_reads_back(tmp_path_factory, steps):
    """However rows come and go, the RAM a put of ``n`` rows is reckoned to take at most
    (``nbytes_with``: what the budget checks first) is at least what it leaves, and every row on
    disk reads back as written; slots given up are taken again before new ones are added:
    those listed as given up lately, and the others once they are 1 in 16 of the slots."""
    cold = store(tmp_path_factory.mktemp("cold"))
    held: set[int] = set()
    next_id = 0
    rng = np.random.default_rng(len(steps))
    for add, n in steps:
        if add or not held:
            ids = np.arange(next_id, next_id + n, dtype=np.int64)
            next_id += n
            expected, free, listed, used = cold.nbytes_with(n), cold.nfree, cold.nfreed, cold.used
            put(cold, ids)
            assert cold.nbytes <= expected
            # the slots listed first; the others once they are 1 in 16 of the slots
            reused = min(n, listed)
            if (free - listed) * 16 >= used:
                reused += min(n - reused, free - listed)
            assert cold.nfree == free - reused and cold.used == used + n - reused
            held.update(ids.tolist())
        else:
            gone = rng.choice(np.array(sorted(held), np.int64), min(n, len(held)), replace=False)
            cold.remove(gone)
            held.difference_update(gone.tolist())
        assert len(cold) == len(held)
        assert cold.used - cold.nfree == len(held)
    ids = np.array(sorted(held), np.int64)
    slots = cold.find(ids)
    assert (slots >= 0).all() and np.unique(slots).size == ids.size
    got = cold.read(cold.places[slots], {})
    np.testing.assert_array_equal(got["ids"], ids)
    np.testing.assert_array_equal(got["rows"][:, 1], -ids.astype(np.float32))


def test_slots_given_up_a_request_at_a_time_are_taken_again_from_a_list_without_a_scan(tmp_path):
    """A promotion gives up a few slots among many, and the rows it moves out take as many
    again: they take those very slots, from the list of slots given up lately, with no scan
    for slots not in use (which crossed most of a tier's slots to find a few thousand among
    millions). Past what the list holds, the rest are found by a scan, and no slot is given
    twice."""
    cold = store(tmp_path, segment_rows=1 << 12)
    rng = np.random.default_rng(0)
    held = np.arange(20_000, dtype=np.int64)
    put(cold, held)
    used, next_id = cold.used, held.size
    for _ in range(20):
        gone = rng.choice(held, 50, replace=False)
        given_up = cold.find(gone)
        cold.remove(gone)
        new = np.arange(next_id, next_id + 50, dtype=np.int64)
        next_id += new.size
        put(cold, new)
        np.testing.assert_array_equal(np.sort(cold.find(new)), np.sort(given_up))
        held = np.concatenate([np.setdiff1d(held, gone), new])
    assert cold.cursor == 0 and cold.used == used  # no scan, and no slot added

    gone = rng.choice(held, 3_000, replace=False)  # more than the list holds
    cold.remove(gone)
    assert 0 < cold.nfreed < gone.size
    new = np.arange(next_id, next_id + 2_000, dtype=np.int64)
    put(cold, new)
    held = np.concatenate([np.setdiff1d(held, gone), new])
    slots = cold.find(held)
    assert cold.used == used and cold.nfree == 1_000
    assert (slots >= 0).all() and np.unique(slots).size == held.size
    got = cold.read(cold.places[slots], {})
    np.testing.assert_array_equal(got["ids"], held)
    np.testing.assert_array_equal(got["rows"][:, 1], -held.astype(np.float32))


def test_a_place_is_never_given_twice_so_a_read_from_before_is_told_stale(tmp_path):
    """A segment whose rows all went is deleted; the next rows go to a segment of a new
    number, so a read of a place taken before is never taken for a row written since."""
    cold = store(tmp_path, segment_rows=8)
    first = np.arange(8, dtype=np.int64)
    put(cold, np.arange(16, dtype=np.int64))  # two segments: the first full, not being written
    slots = cold.find(first)
    before = cold.places[slots].copy()
    cold.remove(first)
    assert 0 not in cold.segments  # all dead: deleted
    again = np.arange(100, 108, dtype=np.int64)
    put(cold, again)
    taken = cold.find(again)
    assert set(taken.tolist()) == set(slots.tolist())  # the slots given up, taken again
    assert not np.isin(cold.places[taken], before).any()
    assert not cold.current(slots, before).any()
    assert cold.current(taken, cold.places[taken]).all()


def test_places_take_32_bits_and_a_tier_past_their_reach_refuses_a_segment_changing_nothing(tmp_path):
    """A place is held in 4 bytes (a handle of its segment, and the record in it): the
    handles of a segment that went are given again, while every place still reads back
    whole and is never given twice; a put that needs a segment past what 32 bits reach is
    refused before anything is written."""
    from pstrain.errors import ResourceExhaustedError

    cold = store(tmp_path, segment_rows=1 << 30)  # 30 bits a record: 3 handles in all
    assert cold.places.codes.dtype == np.uint32

    def put_slotted(ids: np.ndarray) -> None:  # rows of another layout: a segment of their own
        rows = np.stack([ids, -ids], axis=1).astype(np.float32)
        cold.put(ids, rows, {"acc": rows + 1}, np.zeros(ids.size, META), np.zeros(ids.size, np.int64))

    def check(ids: np.ndarray) -> None:
        got = cold.read(cold.places[cold.find(ids)], {"acc": 0.5})
        np.testing.assert_array_equal(got["ids"], ids)
        np.testing.assert_array_equal(got["rows"][:, 1], -ids.astype(np.float32))

    put(cold, np.arange(0, 10, dtype=np.int64))
    put_slotted(np.arange(10, 20, dtype=np.int64))
    put(cold, np.arange(20, 30, dtype=np.int64))
    files = sorted(os.listdir(cold.directory))
    with pytest.raises(ResourceExhaustedError, match="at most"):
        put_slotted(np.arange(30, 40, dtype=np.int64))
    assert len(cold) == 30 and sorted(os.listdir(cold.directory)) == files
    check(np.arange(30, dtype=np.int64))
    before = cold.places[cold.find(np.arange(10, 20, dtype=np.int64))]
    cold.remove(np.arange(10, 20, dtype=np.int64))  # its segment goes, and gives its handle back
    put_slotted(np.arange(30, 40, dtype=np.int64))
    check(np.concatenate([np.arange(10), np.arange(20, 40)]).astype(np.int64))
    now = cold.places[cold.find(np.arange(30, 40, dtype=np.int64))]
    assert not np.isin(now, before).any() and (now >> 32 == 3).all()  # segment 3, not 1 again


def test_eviction_keys_past_32_bits_keep_their_order_and_the_newest_their_value(tmp_path):
    """Keys are held in 32 bits past a base that moves on when a key passes them: the
    newest keys read back exactly; keys more than ``KEY_SPAN`` below the newest order as
    that far below; the rows with the lowest keys are still the victims."""
    cold = store(tmp_path)
    old, mid, new = (np.arange(k, k + 10, dtype=np.int64) for k in (0, 100, 200))
    put(cold, old, np.arange(10, dtype=np.int64) + 5)
    big = (1 << 33) + 7
    put(cold, mid, np.full(10, big - KEY_SPAN // 2))
    put(cold, new, big + np.arange(10, dtype=np.int64))
    np.testing.assert_array_equal(cold.keys_of(cold.find(new)), big + np.arange(10))
    np.testing.assert_array_equal(cold.keys_of(cold.find(mid)), np.full(10, big - KEY_SPAN // 2))
    assert (cold.keys_of(cold.find(old)) == big - KEY_SPAN // 2 - KEY_SPAN).all()  # clamped
    assert set(cold.victims(10).tolist()) == set(old.tolist())
    assert set(cold.victims(20).tolist()) == set(old.tolist()) | set(mid.tolist())


def test_the_index_of_rows_on_disk_grows_a_part_at_a_time():
    """Its parts grow on their own: an insert that grows the index holds the old slots of
    the parts that grow besides the new ones (traced allocations), never the whole index
    twice; what it reckons a batch may take covers what the batch took, growth and all."""
    index = PartitionedIndex(KERNELS, 0.75, 1.25)
    ids = np.random.default_rng(5).permutation(1 << 20).astype(np.int64) * 9_973
    batch = 1 << 13
    # What an insert may hold besides what the index grew by: a growing part's old slots
    # (about a sixteenth of the index) and a few arrays of the batch with the compiled
    # kernels; with numpy's (PSTRAIN_KERNELS=numpy), which rebuild a part and probe a batch
    # in passes of whole arrays, a few copies of a part and a dozen arrays of the batch.
    # Either stays below the whole index held twice (sixteen sixteenths).
    parts, per_id = (3, 64) if KERNELS.__name__.endswith("compiled") else (8, 256)
    tracemalloc.start()
    try:
        for lo in range(0, ids.size, batch):
            part = ids[lo : lo + batch]
            before, reckoned = index.nbytes, index.nbytes_holding(len(index) + part.size)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            index.insert(part, np.arange(lo, lo + part.size))
            peak = tracemalloc.get_traced_memory()[1] - base
            grew = index.nbytes - before
            # (a part's old slots: about a sixteenth of the index; a whole index, 16 times that)
            assert peak <= grew + parts * before // 16 + per_id * part.size, (lo, peak, grew, before)
            assert index.nbytes <= reckoned
    finally:
        tracemalloc.stop()
    assert len(index) == ids.size and index.nbytes < 12 * ids.size / 0.75 * 1.25 + 16 * 12 * 16
    np.testing.assert_array_equal(index.get(ids[::7]), np.arange(0, ids.size, 7))


def test_a_linked_checkpoint_file_reads_as_records_of_the_rows_it_holds(tmp_path):
    """A checkpoint file linked in (a tiered restore's base) reads by column as the records
    of its rows, beside segments of records and through every reader (a lookup's, a save's,
    a move's); written in place after, a read of it is a DataLossError, never other rows."""
    from pstrain._formats.files.tensor_files import TensorFile, write_tensors
    from pstrain.errors import DataLossError

    rng = np.random.default_rng(0)
    ids = rng.permutation(1000).astype(np.int64)[:300]
    rows = rng.standard_normal((300, 2)).astype(np.float32)
    acc = rng.random((300, 2)).astype(np.float32)
    path = tmp_path / "base.safetensors"
    write_tensors(str(path), {"ids": ids, "rows": rows, "slot:accumulator": acc})
    cold = store(tmp_path)
    put(cold, np.arange(5000, 5100, dtype=np.int64))  # records of their own, before and after
    keep = np.ones(300, bool)
    keep[::7] = False  # rows another shard holds, or a delta changed: dead from the start
    with TensorFile(str(path)) as f:
        at = {
            "id": f.tensors["ids"].at,
            "row": f.tensors["rows"].at,
            "slot0": f.tensors["slot:accumulator"].at,
        }
        number = cold.files.link(str(path), f.fileno(), 300, int(keep.sum()), at, ("accumulator",))
    assert os.stat(path).st_nlink == 2
    records = np.flatnonzero(keep)
    cold.add(
        ids[keep],
        (np.int64(number) << 32) | records,
        np.zeros(records.size, np.uint32),
        np.zeros(records.size, np.int64),
    )
    put(cold, np.arange(6000, 6050, dtype=np.int64))
    want = np.concatenate([ids[keep], np.arange(5000, 5100), np.arange(6000, 6050)])
    places = cold.places[cold.find(want)]
    got = cold.read(places, {"accumulator": 0.1})
    np.testing.assert_array_equal(got["ids"], want)
    np.testing.assert_array_equal(got["rows"][: records.size], rows[keep])
    np.testing.assert_array_equal(got["slot:accumulator"][: records.size], acc[keep])
    assert (got["slot:accumulator"][records.size :] == np.float32(0.1)).all()  # (theirs: not carried)
    assert not got["meta"][: records.size].view(np.uint8).any()  # (as a restore sets them)
    ordered = np.sort(places)
    filled = cold.fill_many(ordered, ["ids", "rows", "slot:accumulator"], {"accumulator": 0.1})
    np.testing.assert_array_equal(filled["ids"], cold.read(ordered, {"accumulator": 0.1})["ids"])
    linked_places = ordered[(ordered >> 32) == number]
    run, slots = cold.records_from(linked_places)
    assert slots == ("accumulator",) and run.size == records.size
    np.testing.assert_array_equal(run["id"], ids[keep])
    np.testing.assert_array_equal(run["slot0"], acc[keep])
    # every row of the file taken back: the link goes, the checkpoint's own name stays
    cold.remove(ids[keep])
    removals_done(timeout=30)  # (dead segments are unlinked on the remover's thread)
    assert os.stat(path).st_nlink == 1 and number not in cold.segments
    # linked again, then the file written in place
    with TensorFile(str(path)) as f:
        number = cold.files.link(str(path), f.fileno(), 300, 300, at, ("accumulator",))
    cold.add(
        ids, (np.int64(number) << 32) | np.arange(300), np.zeros(300, np.uint32), np.zeros(300, np.int64)
    )
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataLossError, match="written in place"):
        cold.read(cold.places[cold.find(ids[:3])], {"accumulator": 0.1})


def test_a_discarded_tier_leaves_its_path_at_once_and_its_files_on_a_thread(tmp_path):
    """A table that goes (a restore replaced it) gives its directory's name back at once and
    its files soon after, deleted off the serving loop (a tier of gigabytes took seconds)."""
    cold = store(tmp_path, segment_rows=8)
    put(cold, np.arange(100, dtype=np.int64))
    directory = cold.directory
    assert len(os.listdir(directory)) > 1
    cold.discard()
    assert not os.path.exists(directory)
    removals_done(timeout=30)
    assert os.listdir(tmp_path) == []


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 200),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 199), st.integers(0, 199), st.integers(0, 2**32)), max_size=20
    ),
)
def test_the_bits_of_rows_as_made_are_set_and_cleared_slot_by_slot_and_by_range(tmp_path_factory, size, ops):
    # A bit a cold slot: marked for some slots (set where made, cleared elsewhere), or
    # cleared over a range (a bulk load's: whole bytes at once, its ends bit by bit), each
    # against a list of booleans.
    cold = store(tmp_path_factory.mktemp("bits"))
    cold._room_for(size)
    model = np.zeros(size, bool)
    for by_slot, a, b, seed in ops:
        lo, hi = sorted((a % (size + 1), b % (size + 1)))
        if by_slot:
            rng = np.random.default_rng(seed)
            slots = rng.permutation(size)[: hi - lo].astype(np.int64)
            made = rng.random(slots.size) < 0.5
            cold._mark_made(slots, made)
            model[slots] = made
        else:
            cold._clear_made(lo, hi)
            model[lo:hi] = False
        assert cold.made_at(np.arange(size)).tolist() == model.tolist()
