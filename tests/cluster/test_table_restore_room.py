"""A dynamic table restored into a ps's RAM is refused, before a row of it is read, when it
would take the ps past what it may hold (``--max-store-bytes``), with the tables it holds,
the restores it has staged and those it is reading counted; the table restored into is left
as it was. A restore that fits reads each array once, at its size."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import pstrain
from pstrain.errors import ResourceExhaustedError
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
