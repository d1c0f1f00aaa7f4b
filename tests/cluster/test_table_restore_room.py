"""A dynamic table restored into a ps's RAM is refused, before a row of it is read, when it
would take the ps past what it may hold (``--max-store-bytes``), with the tables it holds,
the restores it has staged and those it is reading counted; the table restored into is left
as it was. A restore that fits reads each array once, at its size."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

import pstrain
from pstrain.errors import ResourceExhaustedError
from pstrain.server.ps.checkpoints import saves
from pstrain.server.ps.tables.table_restores import TableRestores
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(90)

DIM = 64
IDS = np.arange(20_000, dtype=np.int64) * 7
NEED = IDS.size * DIM * 4 * 2  # a shard's rows and Adagrad's accumulator: 10.24 MB


async def _saved(root, names=("emb",)) -> tuple[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """A save of tables ``names``, each of IDS's rows trained once with Adagrad, and each
    table's ids and rows as saved."""
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(root)}
    ) as cluster:
        with pstrain.ParameterServerStrategy(cluster.resolver).scope():
            tables = {n: pstrain.DynamicEmbedding(DIM, name=n) for n in names}
            opt = pstrain.optimizers.Adagrad(0.1)
        for i, table in enumerate(tables.values()):
            await table.lookup(IDS)
            grad = np.full((IDS.size, DIM), i + 1, np.float32)
            await opt.apply_gradients([(pstrain.IndexedSlices(grad, IDS), table)])
        path = await pstrain.Checkpoint(model=tables, optimizer=opt).save(str(root / "c"))
        return path, {n: await t.export() for n, t in tables.items()}


def _fresh(root):
    return InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(root)})


def _room(ps, more: int) -> None:
    """What the ps may hold (``--max-store-bytes``): what it holds now and ``more``."""
    ps.table_handlers.max_store_bytes = ps.table_handlers.held() + more


async def test_a_table_too_large_for_the_ps_is_refused_before_its_rows_are_read_and_nothing_changes(
    tmp_path,
):
    path, _ = await _saved(tmp_path)
    async with _fresh(tmp_path) as cluster:
        with pstrain.ParameterServerStrategy(cluster.resolver).scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        before = await table.lookup(IDS[:10])
        ps = cluster.ps[0]
        _room(ps, NEED - 1)
        tracemalloc.start()
        try:
            with pytest.raises(ResourceExhaustedError, match=r"20000 rows.*--max-store-bytes") as refused:
                await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # its ids (read to know its rows) and what a request takes, not its rows
        assert peak < NEED / 3, peak
        assert "--memory-budget" in str(refused.value)  # and what to do instead
        assert ps.table_handlers.held() <= ps.table_handlers.max_store_bytes
        assert (await table.statistics())["rows"] == 10
        np.testing.assert_array_equal(await table.lookup(IDS[:10]), before)
        assert ps.table_handlers.restores.staged_bytes() == 0


async def test_tables_restored_together_count_each_other_and_none_is_put_in_place(tmp_path):
    """Two tables that each fit beside what the ps holds, but not together: the restore of
    the job (all or nothing) fails and neither table changes; with room for both, both
    come back as saved."""
    path, saved = await _saved(tmp_path, ("a", "b"))
    for fits in (False, True):
        async with _fresh(tmp_path) as cluster:
            with pstrain.ParameterServerStrategy(cluster.resolver).scope():
                tables = {n: pstrain.DynamicEmbedding(DIM, name=n) for n in ("a", "b")}
                opt = pstrain.optimizers.Adagrad(0.1)
            checkpoint = pstrain.Checkpoint(model=tables, optimizer=opt)
            ps = cluster.ps[0]
            _room(ps, 3 * NEED if fits else 3 * NEED // 2)  # both, or one of them
            if not fits:
                with pytest.raises(ResourceExhaustedError, match="--max-store-bytes"):
                    await checkpoint.restore(path)
                assert [(await t.statistics())["rows"] for t in tables.values()] == [0, 0]
                assert ps.table_handlers.held() <= ps.table_handlers.max_store_bytes
                assert ps.table_handlers.restores.staged_bytes() == 0
                continue
            await checkpoint.restore(path)
            for name, table in tables.items():
                for got, want in zip(await table.export(), saved[name]):
                    np.testing.assert_array_equal(got, want)
            assert ps.table_handlers.restores.staged_bytes() == 0


async def test_a_variable_and_a_table_restored_together_count_each_other(tmp_path, monkeypatch):
    """A variable's values being read count against the room a table's restore checks (and
    the other way round): here the variable's read lasts until the table's check is over."""
    checked = threading.Event()
    check_room, read_rows = TableRestores._check_room, saves.read_rows

    def check_then_tell(self, *args, **kwargs):
        try:
            return check_room(self, *args, **kwargs)
        finally:
            checked.set()

    def read_once_checked(*args):
        assert checked.wait(30), "the table's restore never checked its room"
        return read_rows(*args)

    monkeypatch.setattr(TableRestores, "_check_room", check_then_tell)
    monkeypatch.setattr(saves, "read_rows", read_once_checked)
    value = np.arange(IDS.size * DIM, dtype=np.float32).reshape(IDS.size, DIM)  # NEED / 2 bytes
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        with pstrain.ParameterServerStrategy(cluster.resolver).scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            dense = pstrain.Variable(value, name="dense")
            opt = pstrain.optimizers.Adagrad(0.1)
        await table.lookup(IDS)
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((IDS.size, DIM), np.float32), IDS), table)])
        path = await pstrain.Checkpoint(emb=table, dense=dense, optimizer=opt).save(str(tmp_path / "c"))
    for fits in (False, True):
        checked.clear()
        async with _fresh(tmp_path) as cluster:
            with pstrain.ParameterServerStrategy(cluster.resolver).scope():
                table = pstrain.DynamicEmbedding(DIM, name="emb")
                dense = pstrain.Variable(np.zeros_like(value), name="dense")
                opt = pstrain.optimizers.Adagrad(0.1)
            await dense.read_value()  # (made on the ps)
            ps = cluster.ps[0]
            _room(ps, 2 * NEED if fits else NEED + NEED // 4)  # both, or either alone
            ps.checkpoints.max_store_bytes = ps.table_handlers.max_store_bytes
            checkpoint = pstrain.Checkpoint(emb=table, dense=dense, optimizer=opt)
            if not fits:
                with pytest.raises(pstrain.errors.ResourceExhaustedError, match="--max-store-bytes"):
                    await checkpoint.restore(path)
                assert (await table.statistics())["rows"] == 0
                np.testing.assert_array_equal(await dense.numpy(), 0)
                continue
            await checkpoint.restore(path)
            assert (await table.statistics())["rows"] == IDS.size
            np.testing.assert_array_equal(await dense.numpy(), value)
