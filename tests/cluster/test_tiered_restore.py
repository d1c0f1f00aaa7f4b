"""A tiered shard restored from a checkpoint links the base's files into its tier instead of
writing their rows again (``tiered_restore.py``): every row and slot as saved, training on
from them as from a copy, saves and compaction reading them, the checkpoint deletable;
a base on another file system copied; a linked file changed in place refused on read."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

import pstrain
from pstrain.testing import InProcessCluster
from tests.cluster.test_tiered import BUDGET, DIM, IDS, _batches, train_with
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(120)


def _cluster(tmp_path, root) -> InProcessCluster:
    options = {
        "memory_budget": BUDGET,
        "table_dir": str(tmp_path / "tier"),
        "checkpoint_root": str(root),
        "table_segment_rows": 256,
    }
    return InProcessCluster(num_ps=2, num_workers=1, token=TOKEN, ps_options=options)


def _new(strategy):
    with strategy.scope():
        return pstrain.DynamicEmbedding(DIM, name="emb"), pstrain.optimizers.Adagrad(0.1)


async def _chain(table, opt, directory, batches) -> str:
    """A base after most of ``batches``, then two deltas; returns the last's path."""
    manager = pstrain.CheckpointManager(
        pstrain.Checkpoint(model={"emb": table}, optimizer=opt), str(directory), max_to_keep=None
    )
    await train_with(table, opt, batches[:-4])
    await manager.save()
    last = ""
    for k in (-4, -2):
        await train_with(table, opt, batches[k : k + 2 or None])
        last = await manager.save_delta()
    await manager.close()
    return last


def _links(cluster) -> list[os.stat_result]:
    """The files a restore linked into each ps's tier."""
    out = []
    for ps in cluster.ps:
        directory = ps.tables["emb"].cold.directory
        out += [os.stat(os.path.join(directory, n)) for n in os.listdir(directory) if n.endswith(".ref")]
    return out


async def test_a_tiered_restore_links_its_base_and_trains_on_as_from_a_copy(tmp_path):
    batches = _batches()
    # ids swept evenly: most rows of the linked files come back to RAM (then die there)
    sweeps = [np.sort(p[:512]) for p in map(np.random.default_rng(3).permutation, [IDS] * 12)]
    async with _cluster(tmp_path, tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt = _new(strategy)
        last = await _chain(table, opt, tmp_path / "chain", batches)
        want_ids, want_rows = await table.export()
        fresh, opt2 = _new(strategy)
        await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(last)
        # each ps's part of the base is in its tier as the checkpoint's own file, not a copy
        base = {(p.stat().st_dev, p.stat().st_ino) for p in (tmp_path / "chain").rglob("*") if p.is_file()}
        links = _links(cluster)
        assert len(links) == 2 and all(s.st_nlink == 2 for s in links), links
        assert {(s.st_dev, s.st_ino) for s in links} <= base
        stats = await fresh.statistics()
        assert stats["cold_rows"] > stats["hot_rows"] > 0, stats
        got_ids, got_rows = await fresh.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)
        # the checkpoint deleted: the tier keeps its blocks, every row still read
        shutil.rmtree(tmp_path / "chain")
        np.testing.assert_array_equal((await fresh.export())[1], want_rows)
        # steps on: rows and Adagrad accumulators (read by column from the linked files) as a
        # ps holding everything in RAM has them after the same restore and steps; the linked
        # files' rows brought back die there, and a linked file half dead is compacted
        await train_with(fresh, opt2, sweeps)

        async def compacted() -> bool:  # (after the requests that left a linked file half dead)
            return (await fresh.statistics())["compacted"] > stats["compacted"]

        await wait_for(compacted, timeout=30, what="a compaction of a linked file")
        saved = await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).save(str(tmp_path / "again"))
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as ram:
        strategy = pstrain.ParameterServerStrategy(ram.resolver)
        table, opt = _new(strategy)
        await _chain(table, opt, tmp_path / "chain2", batches)
        await train_with(table, opt, sweeps)
        want_ids, want_rows = await table.export()
        # the save after the restore (its rows read from the linked files, then records)
        # holds the same rows as the steps in RAM
        copy, opt3 = _new(strategy)
        await pstrain.Checkpoint(model={"emb": copy}, optimizer=opt3).restore(saved)
        got_ids, got_rows = await copy.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)


async def test_a_base_on_another_file_system_is_copied_into_the_tier(tmp_path):
    root = tempfile.mkdtemp(prefix="pstrain-test-", dir="/dev/shm")
    try:
        assert os.stat(root).st_dev != os.stat(tmp_path).st_dev  # (tmpfs, the tier on disk)
        batches = _batches()
        async with _cluster(tmp_path, root) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            table, opt = _new(strategy)
            last = await _chain(table, opt, os.path.join(root, "chain"), batches)
            want_ids, want_rows = await table.export()
            fresh, opt2 = _new(strategy)
            await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(last)
            assert _links(cluster) == []
            assert (await fresh.statistics())["cold_rows"] > 0
            got_ids, got_rows = await fresh.export()
            np.testing.assert_array_equal(got_ids, want_ids)
            np.testing.assert_array_equal(got_rows, want_rows)
    finally:
        shutil.rmtree(root)


async def test_a_linked_file_written_in_place_is_an_error_on_read_never_other_rows(tmp_path):
    batches = _batches()
    async with _cluster(tmp_path, tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt = _new(strategy)
        last = await _chain(table, opt, tmp_path / "chain", batches)
        fresh, opt2 = _new(strategy)
        await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(last)
        links = _links(cluster)
        assert links
        path = next(
            p for p in (tmp_path / "chain").rglob("*") if p.is_file() and p.stat().st_ino == links[0].st_ino
        )
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))  # (the same file: written in place, as pstrain never does)
        with pytest.raises(pstrain.errors.DataLossError, match="written in place"):
            await fresh.export()
