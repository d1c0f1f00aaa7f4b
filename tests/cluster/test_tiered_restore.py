"""A tiered shard restored from a checkpoint links the base's files into its tier instead of
writing their rows again (``tiered_restore.py``): every row and slot as saved, training on
from them as from a copy, saves and compaction reading them, the checkpoint deletable;
a base on another file system copied; a linked file changed in place refused on read."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import tracemalloc
from typing import Any

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import load_file

import pstrain
from pstrain.checkpoint import load_variables
from pstrain.testing import InProcessCluster
from tests.cluster.test_feed import table_feed
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
        return pstrain.DynamicEmbedding(DIM, name="emb"), _optimizer(strategy)


def _optimizer(strategy):
    with strategy.scope():
        return pstrain.optimizers.Adagrad(0.1)


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


def _links(cluster, table) -> list[os.stat_result]:
    """The files a restore linked into each ps's tier of ``table``."""
    out = []
    for ps in cluster.ps:
        directory = ps.tables[table.key].cold.directory
        out += [os.stat(os.path.join(directory, n)) for n in os.listdir(directory) if n.endswith(".ref")]
    return out


async def test_a_tiered_restore_links_its_base_and_trains_on_as_from_a_copy(tmp_path):
    batches = _batches()
    # ids swept evenly: most rows of the linked files come back to RAM (then die there)
    sweeps = [np.sort(p[:512]) for p in map(np.random.default_rng(3).permutation, [IDS] * 16)]
    async with _cluster(tmp_path, tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt = _new(strategy)
        last = await _chain(table, opt, tmp_path / "chain", batches)
        want_ids, want_rows = await table.export()
        fresh, opt2 = table, _optimizer(strategy)  # (restored in place: its shards replaced)
        await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(last)
        # each ps's part of the base is in its tier as the checkpoint's own file, not a copy
        base = {(p.stat().st_dev, p.stat().st_ino) for p in (tmp_path / "chain").rglob("*") if p.is_file()}
        links = _links(cluster, fresh)
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
            assert _links(cluster, fresh) == []
            assert (await fresh.statistics())["cold_rows"] > 0
            got_ids, got_rows = await fresh.export()
            np.testing.assert_array_equal(got_ids, want_ids)
            np.testing.assert_array_equal(got_rows, want_rows)
    finally:
        shutil.rmtree(root)


async def test_a_base_damaged_where_the_hot_set_is_read_is_refused_before_it_is_served(tmp_path):
    """The linked files are checked through while the shard fills, whose own reads of them
    (the rows the hot set takes, the first in the file) check nothing: a base damaged there
    is still refused whole, and the table restored before serves on as it was."""
    from pstrain._formats.files.tensor_files import TensorFile

    async with _cluster(tmp_path, tmp_path) as cluster:
        fresh, _, _, last = await _restored(cluster, tmp_path, _batches(), [])
        assert len(_links(cluster, fresh)) == 2  # (linked: the check runs beside the fill)
        want_ids, want_rows = await fresh.export()
        base = _table_files(tmp_path / "chain", "ckpt-1")
        with TensorFile(str(base[0])) as f:
            at = f.tensors["rows"].at  # the first row's first byte: one the hot set takes
        data = bytearray(base[0].read_bytes())
        data[at] ^= 0x40
        base[0].unlink()  # (a new file: the tier's link keeps the one it holds)
        base[0].write_bytes(bytes(data))
        again, opt3 = _new(pstrain.ParameterServerStrategy(cluster.resolver))
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="checksum|damaged"):
            await pstrain.Checkpoint(model={"emb": again}, optimizer=opt3).restore(last)
        got_ids, got_rows = await fresh.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)


async def test_a_linked_file_written_in_place_is_an_error_on_read_never_other_rows(tmp_path):
    async with _cluster(tmp_path, tmp_path) as cluster:
        fresh, *_ = await _restored(cluster, tmp_path, _batches(), [])
        links = _links(cluster, fresh)
        assert links
        path = next(
            p for p in (tmp_path / "chain").rglob("*") if p.is_file() and p.stat().st_ino == links[0].st_ino
        )
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))  # (the same file: written in place, as pstrain never does)
        with pytest.raises(pstrain.errors.DataLossError, match="written in place"):
            await fresh.export()


async def _restored(cluster, tmp_path, batches, steps) -> tuple[Any, Any, Any, str]:
    """A table trained on ``batches`` and saved as a base and two deltas, restored in place
    with a new optimizer (its shards replaced, its base linked into each ps's tier) and
    trained on ``steps``: the table, its optimizer, a Checkpoint of both and the path
    restored."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    table, opt = _new(strategy)
    last = await _chain(table, opt, tmp_path / "chain", batches)
    fresh, opt2 = table, _optimizer(strategy)
    checkpoint = pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2)
    await checkpoint.restore(last)
    await train_with(fresh, opt2, steps)
    return fresh, opt2, checkpoint, last


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _table_files(directory, prefix: str) -> list:
    return sorted(p for p in directory.glob(f"{prefix}.ps*.table-*.safetensors") if ".link-" not in p.name)


async def test_a_full_save_after_a_restore_links_the_base_rows_that_did_not_change(tmp_path):
    """A restored shard's next full save links the base's files it keeps in its tier rather
    than write their rows again: the save holds every row and slot as one written whole
    does (the same restore and steps on ps holding everything in RAM), after the base is
    deleted too, and restores into a tier (linking its links in turn) and into RAM."""
    batches = _batches()
    few = [np.sort(np.random.default_rng(5).permutation(IDS)[:64]) for _ in range(3)]
    async with _cluster(tmp_path, tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        _, _, checkpoint, _ = await _restored(cluster, tmp_path, batches, few)
        saved = await checkpoint.save(str(tmp_path / "next"))
        linked = load_variables(saved)
        base = _table_files(tmp_path / "chain", "ckpt-1")
        name = os.path.basename(saved)
        links = sorted(tmp_path.glob(f"{name}.ps*.table-*.link-*.safetensors"))
        # each ps's link is its base file (the same inode: the checkpoint, the tier, the link)
        assert len(base) == 2 and len(links) == 2, (base, links)
        assert {(p.stat().st_ino, p.stat().st_nlink) for p in links} == {(p.stat().st_ino, 3) for p in base}
        # format 3: a pstrain that does not read links refuses it rather than miss rows
        assert json.loads((tmp_path / f"{name}.index.json").read_text())["version"] == 3
        assert json.loads((tmp_path / "chain" / "ckpt-1.index.json").read_text())["version"] == 2
        # the save wrote the rows in RAM and those that changed, not the base's again: most
        # of the table's rows are its links', each row in one file only
        own = [load_file(str(p)) for p in _table_files(tmp_path, name)]
        written = sum(int(f["live"].sum()) for f in own)
        from_links = sum(int(np.unpackbits(f["linked:0"]).sum()) for f in own)
        assert written + from_links == linked["model/emb/ids"].size
        assert from_links > written, (written, from_links)
        shutil.rmtree(tmp_path / "chain")
        _same(load_variables(saved), linked)
        # restored into a tier: its own file and its links linked in, every row as saved
        again, opt3 = _new(strategy)
        await pstrain.Checkpoint(model={"emb": again}, optimizer=opt3).restore(saved)
        assert len(_links(cluster, again)) >= 2
        got_ids, got_rows = await again.export()
        np.testing.assert_array_equal(got_ids, linked["model/emb/ids"])
        np.testing.assert_array_equal(got_rows, linked["model/emb/rows"])
        # and saved from there, links of links: the same rows and slots again
        third = load_variables(
            await pstrain.Checkpoint(model={"emb": again}, optimizer=opt3).save(str(tmp_path / "third"))
        )
        assert list(tmp_path.glob("third-*.link-*.safetensors"))
        _same(third, linked)
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as ram:
        strategy = pstrain.ParameterServerStrategy(ram.resolver)
        table, opt = _new(strategy)
        last = await _chain(table, opt, tmp_path / "chain2", batches)
        copy, opt4 = _new(strategy)
        await pstrain.Checkpoint(model={"emb": copy}, optimizer=opt4).restore(last)
        await train_with(copy, opt4, few)
        in_ram = await pstrain.Checkpoint(model={"emb": copy}, optimizer=opt4).save(str(tmp_path / "ram"))
        whole = load_variables(in_ram)
        assert not list(tmp_path.glob("ram-*.link-*"))
        _same(linked, whole)
        # and the linked save restores into RAM as it reads
        back, opt5 = _new(strategy)
        await pstrain.Checkpoint(model={"emb": back}, optimizer=opt5).restore(saved)
        got_ids, got_rows = await back.export()
        np.testing.assert_array_equal(got_ids, whole["model/emb/ids"])
        np.testing.assert_array_equal(got_rows, whole["model/emb/rows"])


async def test_the_feed_serves_a_save_that_links_its_base_whole(tmp_path):
    batches = _batches()
    few = [np.sort(np.random.default_rng(6).permutation(IDS)[:64]) for _ in range(2)]
    async with _cluster(tmp_path, tmp_path) as cluster:
        fresh, _, checkpoint, _ = await _restored(cluster, tmp_path, batches, few)
        manager = pstrain.CheckpointManager(checkpoint, str(tmp_path / "served"))
        await manager.save()
        await manager.close()
        assert len(list((tmp_path / "served").glob("*.link-*.safetensors"))) == 2
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "emb", TOKEN)
        async with aiohttp.ClientSession() as session:
            assert await mirror.poll(session) > 0 and mirror.resets == 2
        ids, rows = await fresh.export()
        got_ids, got_rows = mirror.snapshot()
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_rows, rows)


async def test_a_save_with_links_restores_onto_another_number_of_tiered_ps(tmp_path):
    batches = _batches()
    async with _cluster(tmp_path, tmp_path) as cluster:
        _, _, checkpoint, _ = await _restored(cluster, tmp_path, batches, batches[:2])
        saved = await checkpoint.save(str(tmp_path / "next"))
        assert len(list(tmp_path.glob("next-*.link-*.safetensors"))) == 2
    want = load_variables(saved)
    options = {
        "memory_budget": BUDGET,
        "table_dir": str(tmp_path / "tier3"),
        "checkpoint_root": str(tmp_path),
    }
    async with InProcessCluster(num_ps=3, num_workers=1, token=TOKEN, ps_options=options) as three:
        strategy = pstrain.ParameterServerStrategy(three.resolver)
        table, opt = _new(strategy)
        await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(saved)
        assert (await table.statistics())["cold_rows"] > 0
        ids, rows = await table.export()
        np.testing.assert_array_equal(ids, want["model/emb/ids"])
        np.testing.assert_array_equal(rows, want["model/emb/rows"])
        # and saved from there (its links' rows of other shards copied, not linked): the same
        again = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "3"))
        _same(load_variables(again), want)


async def test_tables_restored_together_onto_a_tiered_ps_stay_within_its_budget_and_train(tmp_path):
    """Three tables restored at once (one restore, all or nothing) onto a ps with a budget:
    each shard's rows in RAM are reckoned with the others' (the first takes the hot share's
    room, the others their hot set's floor), so the ps holds no more than its budget; every
    row is as saved, and each table takes a request of many rows at once after it."""
    names = ("a", "b", "c")
    ids = np.arange(30_000, dtype=np.int64) * 7
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        with pstrain.ParameterServerStrategy(cluster.resolver).scope():
            tables = {n: pstrain.DynamicEmbedding(16, name=n) for n in names}
            opt = pstrain.optimizers.Adagrad(0.1)
        for table in tables.values():
            await table.lookup(ids)
            grad = pstrain.IndexedSlices(np.ones((ids.size, 16), np.float32), ids)
            await opt.apply_gradients([(grad, table)])
        path = await pstrain.Checkpoint(model=tables, optimizer=opt).save(str(tmp_path / "c"))
        saved = {n: await t.export() for n, t in tables.items()}
    options = {
        "memory_budget": 12 << 20,  # each table's 30,000 rows: 5.4 MB in RAM with their index
        "table_dir": str(tmp_path / "tier"),
        "checkpoint_root": str(tmp_path),
    }
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options) as cluster:
        with pstrain.ParameterServerStrategy(cluster.resolver).scope():
            tables = {n: pstrain.DynamicEmbedding(16, name=n) for n in names}
            opt = pstrain.optimizers.Adagrad(0.1)
        await pstrain.Checkpoint(model=tables, optimizer=opt).restore(path)
        ps = cluster.ps[0]
        assert ps.table_handlers.held() <= ps.store.budget.limit
        stats = [await t.statistics() for t in tables.values()]
        assert all(s["hot_rows"] > 1000 and s["cold_rows"] > 0 for s in stats), stats
        for name, table in tables.items():
            got = await table.export()
            order = np.argsort(got[0])
            np.testing.assert_array_equal(got[0][order], np.sort(saved[name][0]))
            np.testing.assert_array_equal(got[1][order], saved[name][1][np.argsort(saved[name][0])])
        for table in tables.values():  # 2,000 rows at once, most of them read back from disk
            await opt.apply_gradients(
                [(pstrain.IndexedSlices(np.ones((2000, 16), np.float32), ids[-2000:]), table)]
            )
        assert ps.table_handlers.held() <= ps.store.budget.limit


async def test_a_tiered_restore_of_deltas_larger_than_the_budget_reads_them_a_piece_at_a_time(tmp_path):
    """A chain whose deltas each changed every row, restored onto a ps with a budget: the
    deltas' rows go to the tier a piece at a time, as the base's do, instead of being read
    whole and composed in RAM first (the code before held all of them: 64 MB under a 4 MiB
    budget here). Every row and accumulator comes back as the last delta saved it."""
    rows, deltas, budget = 60_000, 4, 4 << 20
    ids = np.arange(rows, dtype=np.int64)
    batches = [ids[lo : lo + 5000] for lo in range(0, rows, 5000)]
    options = {"memory_budget": budget, "checkpoint_root": str(tmp_path)}
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={**options, "table_dir": str(tmp_path / "t0")}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt = _new(strategy)
        manager = pstrain.CheckpointManager(
            pstrain.Checkpoint(model={"emb": table}, optimizer=opt), str(tmp_path / "c"), max_to_keep=None
        )
        await train_with(table, opt, batches)
        await manager.save()
        for _ in range(deltas):  # (each delta: every row, about 7.7 MB with its accumulator)
            await train_with(table, opt, batches)
            last = await manager.save_delta()
        await manager.close()
        want = _by_id(load_variables(last))
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={**options, "table_dir": str(tmp_path / "t1")}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt = _new(strategy)
        await table.lookup(ids[:3])  # (the table made: its restore replaces its shard)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).restore(last)
            added = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert added < 4 * budget, added  # (the hot set, the plan's ids, a few pieces)
        assert cluster.ps[0].table_handlers.held() <= cluster.ps[0].store.budget.limit
        stats = await table.statistics()
        assert stats["cold_rows"] > stats["hot_rows"] > 0, stats
        saved = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "again"))
        _same(_by_id(load_variables(saved)), want)


def _by_id(saved: dict) -> dict:
    """A checkpoint's tensors (:func:`load_variables`), its table's rows and slots in the
    order of their ids."""
    order = np.argsort(saved["model/emb/ids"])
    return {k: v[order] if v.shape[:1] == order.shape else v for k, v in saved.items()}
