"""A restore in place onto a tiered shard whose budget cannot hold the old shard and the
new one together sets the old one aside on disk (``set_aside.py``): the ps stays within
its budget, requests for the table wait and get the restored rows, and a restore that
fails serves the old shard again exactly as it was."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import numpy as np
import pytest

import pstrain
from pstrain._kernels import KERNELS
from pstrain.checkpoint import load_variables
from pstrain.testing import InProcessCluster
from tests.cluster.test_tiered import DIM, train_with
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(180)

BUDGET = 8 << 20
#: Rows of the table: the index of those on disk takes more than half the budget (about
#: 30 bytes a row), so two shards' do not fit it.
ROWS = 150_000
IDS = np.arange(ROWS, dtype=np.int64) * 7 + 3
BATCHES = [IDS[lo : lo + 5000] for lo in range(0, ROWS, 5000)]


def _cluster(tmp_path) -> InProcessCluster:
    options = {
        "memory_budget": BUDGET,
        "table_dir": str(tmp_path / "tier"),
        "checkpoint_root": str(tmp_path),
        "table_segment_rows": 1 << 15,
    }
    return InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options)


def _by_id(saved: dict) -> dict:
    order = np.argsort(saved["model/emb/ids"])
    return {k: v[order] if v.shape[:1] == order.shape else v for k, v in saved.items()}


def _damage_last_row(path) -> None:
    """Flip a bit of the last row of a saved table's file (a new file: a tier's link keeps
    the one it holds): found by the check that reads the rows through, after the plan
    (which reads the ids alone) and the old shard set aside."""
    from pstrain._formats.files.tensor_files import TensorFile

    with TensorFile(str(path)) as f:
        rows = f.tensors["rows"]
        at = rows.at + rows.nbytes - 5
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.unlink()
    path.write_bytes(bytes(data))


async def _trained_and_saved(cluster, tmp_path):
    """A full table, saved, then trained on (every row changed): the table, its optimizer
    and the checkpoint's path."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="emb")
        opt = pstrain.optimizers.Adagrad(0.1)
    await train_with(table, opt, BATCHES)
    path = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "c" / "ckpt"))
    await train_with(table, opt, BATCHES)
    return table, opt, path


async def test_a_restore_onto_a_full_tiered_shard_sets_the_old_one_aside_and_stays_within_the_budget(
    tmp_path,
):
    tracemalloc.start()  # (from the first row: the old shard's RAM let go is seen)
    try:
        async with _cluster(tmp_path) as cluster:
            await _restored_in_place(cluster, tmp_path)
    finally:
        tracemalloc.stop()


async def _restored_in_place(cluster, tmp_path) -> None:
    table, opt, path = await _trained_and_saved(cluster, tmp_path)
    ps = cluster.ps[0]
    shard = ps.table_handlers.tables[table.key]
    assert shard.cold.nbytes > ps.store.budget.limit // 2  # (two such indexes do not fit)
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(path)
    added = tracemalloc.get_traced_memory()[1] - before
    # the old shard's RAM (about the budget) was let go before the new one took its own: the
    # new one's staging then holds under half the budget besides it, or under the budget with
    # the numpy reference kernels (PSTRAIN_KERNELS=numpy), whose index operations make arrays
    # the size of an index as they go (docs/recommender-tables.md): two shards at once would
    # hold about twice the budget either way
    assert added < (BUDGET // 2 if KERNELS.__name__.endswith("compiled") else BUDGET), added
    assert ps.table_handlers.held() <= ps.store.budget.limit
    assert not ps.table_handlers.restores.asides
    assert not os.path.exists(shard.cold.directory)  # (the old shard's disk went)
    saved = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "again"))
    want, got = _by_id(load_variables(path)), _by_id(load_variables(saved))
    assert got.keys() == want.keys() and len(want) > 2, want.keys()  # (rows, ids and a slot at least)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    await train_with(table, opt, BATCHES[:2])  # (and it trains on)


async def test_a_lookup_during_the_restore_waits_and_gets_the_restored_rows(tmp_path):
    async with _cluster(tmp_path) as cluster:
        table, opt, path = await _trained_and_saved(cluster, tmp_path)
        restores = cluster.ps[0].table_handlers.restores
        ids = IDS[::97]
        restore = asyncio.ensure_future(pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(path))
        await wait_for(lambda: restores.asides or restore.done(), timeout=60)
        assert restores.asides  # (the old shard is aside while the new one fills)
        rows = await table.lookup(ids, training=False)
        assert restore.done()  # (the lookup waited for the restore)
        await restore
        want = _by_id(load_variables(path))
        at = np.searchsorted(want["model/emb/ids"], ids)
        np.testing.assert_array_equal(rows, want["model/emb/rows"][at])


async def test_a_restore_that_fails_serves_the_shard_set_aside_as_it_was(tmp_path):
    async with _cluster(tmp_path) as cluster:
        table, opt, path = await _trained_and_saved(cluster, tmp_path)
        handlers = cluster.ps[0].table_handlers
        shard = handlers.tables[table.key]
        want_ids, want_rows = await table.export()
        files = sorted((tmp_path / "c").glob("ckpt-1.ps*.table-*.safetensors"))
        _damage_last_row(files[-1])
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="checksum|damaged"):
            await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(path)
        assert handlers.restores.asides.count == 1  # (before the damage was found)
        assert handlers.tables[table.key] is shard and not handlers.restores.asides
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)
        assert not os.path.exists(os.path.join(shard.cold.directory, "set-aside.npy"))
        await train_with(table, opt, BATCHES[:2])


async def test_a_restore_aborted_by_another_ps_serves_the_shards_set_aside_again(tmp_path):
    """Two ps: one stages its shard (the old one set aside), the other finds its file
    damaged; the coordinator aborts, and the first serves its old shard again before it
    answers the abort."""
    options = {
        "memory_budget": BUDGET // 2,
        "table_dir": str(tmp_path / "tier"),
        "checkpoint_root": str(tmp_path),
        "table_segment_rows": 1 << 15,
    }
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN, ps_options=options) as cluster:
        table, opt, path = await _trained_and_saved(cluster, tmp_path)
        shards = [ps.table_handlers.tables[table.key] for ps in cluster.ps]
        want_ids, want_rows = await table.export()
        files = sorted((tmp_path / "c").glob("ckpt-1.ps*.table-*.safetensors"))
        assert len(files) == 2
        _damage_last_row(files[1])
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="checksum|damaged"):
            await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(path)
        assert [ps.table_handlers.restores.asides.count for ps in cluster.ps] == [1, 1]
        for ps, shard in zip(cluster.ps, shards):
            assert ps.table_handlers.tables[table.key] is shard and not ps.table_handlers.restores.asides
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)
        await train_with(table, opt, BATCHES[:2])
