"""Tiered dynamic tables on real ps (``memory_budget`` and ``table_dir``): training that
matches a ps holding everything in RAM, saves and restores of both tiers, /metrics, and
refusals that change nothing."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import re

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain._formats.messages.operations import (
    ApplyGradients,
    LookupTable,
    LookupTables,
    OptimizerRule,
    TableIds,
)
from pstrain._kernels import KERNELS
from pstrain.errors import InvalidArgumentError, ResourceExhaustedError
from pstrain.server.ps.tables import cold_segments, handlers as table_handlers
from pstrain.server.ps.tables.cold_rows import ColdRows
from pstrain.server.ps.tables.cold_segments import removals_done
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(120)

DIM, STEPS, BATCH, IDS = 16, 24, 512, 20_000
SWEEPS = 6
BUDGET = 1 << 20  # a few thousand rows in RAM on each ps: most of the table goes to disk
#: Batches of 512 unseen ids that leave a ps less than 256 KiB of its budget beside the table
FILLED = 46
FILL_BATCHES = 80  # of 512 unseen ids: about 20,500 rows a ps, past the 14,500-16,500 half its budget indexes


def _batches() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):  # skewed, as real ids are: a few hot, most seen rarely
        ids = np.unique((rng.zipf(1.2, 4 * BATCH) * 7919) % IDS)[:BATCH]
        out.append(np.concatenate([ids, rng.integers(0, IDS, BATCH // 2)]))
    # then ids drawn evenly: rows long on disk come back (the hot set keeps the ids looked
    # up last, so the skewed batches alone bring back too few for a segment to half die)
    out += [rng.permutation(IDS)[:BATCH] for _ in range(SWEEPS)]
    return [np.unique(b).astype(np.int64) for b in out]


async def _train(cluster: InProcessCluster, batches: list[np.ndarray]):
    _, table, opt = await _trained(cluster, batches)
    return table, opt


async def _trained(cluster: InProcessCluster, batches: list[np.ndarray]):
    """A table ``emb`` trained on ``batches`` by Adagrad, with the strategy that made it."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="emb")
        opt = pstrain.optimizers.Adagrad(0.1)
    for ids in batches:
        rows = await table.lookup(ids)
        grad = np.tanh(rows + np.sin(ids)[:, None]).astype(np.float32)
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
    return strategy, table, opt


def _tiered(tmp_path, ps_options: dict | None = None, **kw) -> InProcessCluster:
    options = {
        "memory_budget": BUDGET,
        "table_dir": str(tmp_path / "tier"),
        "checkpoint_root": str(tmp_path),
        "table_segment_rows": 256,  # small segments: some die, some are compacted
        **(ps_options or {}),
    }
    return InProcessCluster(num_ps=2, num_workers=1, token=TOKEN, ps_options=options, **kw)


async def test_a_tiered_table_trains_as_one_in_ram_saves_both_tiers_and_restores_anywhere(
    tmp_path, monkeypatch
):
    # compactions copy a segment's live records a few at a time (a ps's memory is bounded by
    # what it copies at once): here 5 records, so each takes several reads and writes
    record = ColdRows(str(tmp_path / "probe"), DIM, np.dtype(np.float32)).record(("accumulator",))
    monkeypatch.setattr(table_handlers, "COMPACT_BYTES", 5 * record.itemsize)
    batches = _batches()
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        table, _ = await _train(ram, batches)
        want_ids, want_rows = await table.export()
    async with _tiered(tmp_path) as cluster:
        table, opt = await _train(cluster, batches)
        stats = await table.statistics()
        assert stats["rows"] == want_ids.size == stats["hot_rows"] + stats["cold_rows"]
        assert stats["cold_rows"] > stats["hot_rows"] > 0, stats  # most of it on disk
        assert stats["promoted"] > 0 and stats["demoted"] > 0 and stats["refused"] == 0, stats
        assert stats["compacted"] > 5, stats
        for ps in cluster.ps:  # each ps within its budget, its rows on disk in its own directory
            assert ps.table_handlers.held() <= BUDGET
            shard = ps.tables["emb"]
            assert shard.cold.disk_bytes() > 0 and os.listdir(shard.cold.directory)
            assert shard.loop_reads == 0  # every read from disk ran in a stage, before its handler
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)  # bit for bit
        path = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "c"))
        # a save holds both tiers, as load_variables reads any table
        saved = pstrain.checkpoint.load_variables(path)
        np.testing.assert_array_equal(saved["model/emb/ids"], want_ids)
        np.testing.assert_array_equal(saved["model/emb/rows"], want_rows)
        # /metrics shows the tiers
        async with aiohttp.ClientSession() as session:
            async with session.get(
                f"http://{cluster.ps[0].address}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
            ) as resp:
                text = await resp.text()
        cold = [ln for ln in text.splitlines() if ln.startswith("pstrain_table_cold_rows{")]
        assert cold and float(cold[0].rsplit(" ", 1)[1]) > 0, text
        assert "pstrain_table_promoted_total{" in text and "pstrain_table_cold_read_p99_us{" in text
        # how this ps reads from disk: through io_uring wherever this kernel gives a ring
        way = [ln for ln in text.splitlines() if ln.startswith("pstrain_table_cold_reads_io_uring{")]
        assert way and float(way[0].rsplit(" ", 1)[1]) == float(KERNELS.io_uring_reads() is True), text
    # into ps that hold everything in RAM, and into tiered ones again: the same rows
    for tiered in (False, True):
        cluster = (
            _tiered(tmp_path)
            if tiered
            else InProcessCluster(
                num_ps=3, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
            )
        )
        async with cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            with strategy.scope():
                fresh = pstrain.DynamicEmbedding(DIM, name="emb")
                opt2 = pstrain.optimizers.Adagrad(0.1)
            await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(path)
            got_ids, got_rows = await fresh.export()
            np.testing.assert_array_equal(got_ids, want_ids)
            np.testing.assert_array_equal(got_rows, want_rows)
            if tiered:
                assert (await fresh.statistics())["cold_rows"] > 0
                # the restore replaced the shards made by the table's creation, and again
                # now: the replaced ones' rows on disk went with them (their directories out
                # of the way at once, deleted on a thread)
                await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(path)
                for ps in cluster.ps:
                    assert ps.table_handlers.tiering is not None
                    live = os.path.basename(ps.tables["emb"].cold.directory)
                    where = ps.table_handlers.tiering.directory
                    assert [n for n in os.listdir(where) if not n.startswith(".gone-")] == [live]
                    await asyncio.to_thread(removals_done, 30)  # (these ps run in this process)
                    assert os.listdir(where) == [live]
                got_ids, got_rows = await fresh.export()
                np.testing.assert_array_equal(got_rows, want_rows)


def _tiers(cluster: InProcessCluster, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of ``ids`` (each a row of table "emb"), those in RAM and those on disk, now."""
    shards = [ps.tables["emb"] for ps in cluster.ps]
    hot = np.zeros(ids.size, bool)
    cold = np.zeros(ids.size, bool)
    for shard in shards:
        hot |= shard.positions(ids) >= 0
        cold |= shard.cold.find(ids) >= 0
    assert not (hot & cold).any() and (hot | cold).all()
    return ids[hot], ids[cold]


def _placement(cluster: InProcessCluster) -> list[dict[str, int]]:
    keys = ("rows", "hot_rows", "cold_rows", "promoted", "demoted", "looked_up")
    return [{k: ps.tables["emb"].statistics()[k] for k in keys} for ps in cluster.ps]


async def test_rows_back_from_the_page_cache_are_read_on_the_loop_and_the_others_on_a_thread(
    tmp_path, monkeypatch
):
    """A stage reads the records of rows coming back from disk that the page cache holds on
    the serving loop, and hands the others to a thread (here a page cache that holds two
    records in three of each read: the third comes back marked and garbled, as a read that
    stopped short leaves it); a read past ``LOOP_READ_BYTES`` goes to a thread whole. The
    table trains bit for bit as one in RAM either way, and counts the rows read on the loop;
    a lookup that does not train reads its rows on disk the same way, and they are RAM's."""
    batches = _batches()
    cached_records = KERNELS.cached_records

    def some_cached(fd, records, width, out, missed, *args):
        cached_records(fd, records, width, out, missed, *args)
        missed[: records.size : 3] = 1
        out[: records.size : 3] = 0xFF
        return int(records.size - np.count_nonzero(missed[: records.size]))

    sweep = np.arange(IDS, dtype=np.int64)  # every row: most of them on disk
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        table, _ = await _train(ram, batches + batches[:4])
        want_ids, want_rows = await table.export()
        want_looked = await table.lookup(sweep, training=False)
    monkeypatch.setattr(KERNELS, "cached_records", some_cached)
    async with _tiered(tmp_path) as cluster:
        strategy, table, opt = await _trained(cluster, batches)
        stats = await table.statistics()
        assert stats["promoted"] > stats["made_back"], stats  # rows read back from disk
        on_loop, read = stats["cold_rows_from_page_cache"], stats["cold_rows_read"]
        assert 0 < on_loop < read, stats  # some on the loop, the third of each read on a thread
        monkeypatch.setattr(table_handlers, "LOOP_READ_BYTES", 0)  # every read on a thread, whole
        with strategy.scope():
            for ids in batches[:4]:
                rows = await table.lookup(ids)
                grad = np.tanh(rows + np.sin(ids)[:, None]).astype(np.float32)
                await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
        stats = await table.statistics()
        assert stats["cold_rows_read"] > read and stats["cold_rows_from_page_cache"] == on_loop, stats
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)  # bit for bit
        monkeypatch.setattr(table_handlers, "LOOP_READ_BYTES", 4 << 20)
        np.testing.assert_array_equal(await table.lookup(sweep, training=False), want_looked)
        after = await table.statistics()
        assert after["read_through"] > stats["read_through"], after
        assert after["cold_rows_from_page_cache"] > on_loop, after  # (two in three read on the loop)


async def test_a_lookup_that_does_not_train_reads_rows_on_disk_where_they_lie(tmp_path):
    # Evaluation and serving lookups change nothing: rows on disk come back as they are and
    # stay there (no room made in RAM or on disk for them), the hot set keeps training's rows.
    async with _tiered(tmp_path) as cluster:
        table, _ = await _train(cluster, _batches())
        ids, rows = await table.export()
        hot, cold = _tiers(cluster, ids)
        assert cold.size > 1000 and hot.size > 100
        unseen = np.arange(10**12, 10**12 + 40, dtype=np.int64)
        wanted = np.concatenate([cold[::3], hot[::5], unseen])
        # (a compaction under way may move records between the read ahead and the lookup,
        # which then reads those again, on the loop: correct, but not what is counted here)
        await wait_for(lambda: not any(ps.tables["emb"].compacting for ps in cluster.ps), 30, "compactions")
        before = _placement(cluster)
        reads = sum(ps.tables["emb"].read_through for ps in cluster.ps)
        on_loop = sum(ps.tables["emb"].loop_reads for ps in cluster.ps)
        got = await table.lookup(wanted, training=False)
        want = dict(zip(ids.tolist(), rows))
        default = cluster.ps[0].tables["emb"].config.default_value
        expected = np.stack([want.get(i, np.full(DIM, default, np.float32)) for i in wanted.tolist()])
        np.testing.assert_array_equal(got, expected)
        assert _placement(cluster) == before  # nothing moved, nothing made
        assert sum(ps.tables["emb"].read_through for ps in cluster.ps) - reads == cold[::3].size
        assert sum(ps.tables["emb"].loop_reads for ps in cluster.ps) == on_loop  # read on a thread
        assert np.array_equal(_tiers(cluster, ids)[1], cold)

    # the same for a collection's dynamic table (one request per ps for all its tables)
    async with _tiered(tmp_path / "c") as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            coll = pstrain.EmbeddingCollection([pstrain.TableConfig("t", None, DIM, ["f"])], name="c")
        for k in range(FILL_BATCHES // 2):  # unseen ids: most rows go to disk
            await coll.gather({"f": np.arange(k * BATCH, (k + 1) * BATCH)[:, None]})
        dynamic = coll.tables["t"]
        ids, rows = await dynamic.export()
        shards = [ps.tables["c/t"] for ps in cluster.ps]
        cold = ids[np.any([s.cold.find(ids) >= 0 for s in shards], axis=0)]
        assert cold.size > BATCH
        placed = [
            (s.statistics()["hot_rows"], s.statistics()["cold_rows"], s.statistics()["promoted"])
            for s in shards
        ]
        got = await coll.gather({"f": cold[:BATCH, None]}, training=False)
        np.testing.assert_array_equal(got.rows["t"], rows[np.searchsorted(ids, np.sort(cold[:BATCH]))])
        assert [
            (s.statistics()["hot_rows"], s.statistics()["cold_rows"], s.statistics()["promoted"])
            for s in shards
        ] == placed


async def test_a_request_refused_whatever_its_rows_reads_nothing_from_disk_and_moves_nothing(tmp_path):
    # A lookup whose reply would pass the ps's gather limit, a training lookup of more rows
    # than its hot set holds at once, or a gradient of the wrong width, is refused before
    # its rows on disk are read: what a request makes a ps read follows what the ps would
    # send back and hold, never how many ids the request names, and a refused request
    # leaves every row in its tier.
    limit = 256 << 10  # 4,096 rows of 16 floats
    async with _tiered(tmp_path, {"max_gather_bytes": limit}) as cluster:
        batches = _batches()
        table, opt = await _train(cluster, batches)
        await wait_for(lambda: not any(ps.tables["emb"].compacting for ps in cluster.ps), 30, "compactions")
        shard = cluster.ps[0].tables["emb"]
        seen = np.unique(np.concatenate(batches))
        held = seen[shard.has_row(seen)]  # the rows of ps 0, in RAM and on disk
        cold = seen[shard.cold.find(seen) >= 0]  # those on disk
        hot_rows = shard.statistics()["hot_rows"]
        assert held.size * DIM * 4 > limit >= cold.size * DIM * 4 and cold.size > hot_rows
        channel = table.channel(0)

        def disk_reads() -> list[int]:
            return [ps.tables["emb"].statistics()["cold_rows_read"] for ps in cluster.ps]

        before, read, refused = _placement(cluster), disk_reads(), shard.refused
        for train in (False, True):
            with pytest.raises(InvalidArgumentError, match="limit"):
                await channel.request(LookupTable(name=table.key, ids=held, train=train))
            with pytest.raises(InvalidArgumentError, match="limit"):
                await channel.request(LookupTables(lookups=[TableIds(name=table.key, ids=held)], train=train))
        for request in (
            LookupTable(name=table.key, ids=cold, train=True),
            LookupTables(lookups=[TableIds(name=table.key, ids=cold)], train=True),
        ):
            with pytest.raises(ResourceExhaustedError, match="rows in RAM at once"):
                await channel.request(request)
        assert shard.refused == refused + 2  # counted, as refusals for want of room are
        with pytest.raises(InvalidArgumentError, match="values must be"):
            await channel.request(
                ApplyGradients(
                    rule=OptimizerRule(kind="adagrad", learning_rate=0.1),
                    prefix=opt.name,
                    grads=[],
                    tables=[(table.key, cold[:500], np.ones((500, DIM + 1), np.float32))],
                )
            )
        assert _placement(cluster) == before
        assert disk_reads() == read
        # within the limit, a lookup that does not train reads the same rows where they lie
        # (counted by the lookup: a compaction it starts reads from disk too)
        through = shard.read_through
        got = await channel.request(LookupTable(name=table.key, ids=cold, train=False))
        assert got.values[0].shape == (cold.size, DIM)
        assert shard.read_through - through == cold.size
        assert _placement(cluster) == before


async def test_a_full_disk_refuses_what_would_move_rows_and_still_serves_every_row(tmp_path, monkeypatch):
    # The disk fills: a training lookup that needs a row moved to disk is refused whole
    # (counted, saying so), never a dead ps or a zero row; lookups that do not train, exports
    # and saves still read every row; with room again, training goes on.
    async with _tiered(tmp_path) as cluster:
        table, opt = await _train(cluster, _batches())
        ids, rows = await table.export()
        hot, cold = _tiers(cluster, ids)
        real_open = open

        def full(path, mode="r", *args, **kwargs):
            if "a" in mode:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(path, mode, *args, **kwargs)

        monkeypatch.setattr(cold_segments, "open", full, raising=False)
        refused = (await table.statistics())["refused"]
        with pytest.raises(ResourceExhaustedError, match="is full"):
            await table.lookup(cold[:64])  # to bring them back, as many rows must go to disk
        with pytest.raises(ResourceExhaustedError, match="is full"):
            await table.lookup(np.arange(10**12, 10**12 + 4 * BATCH, dtype=np.int64))
        assert (await table.statistics())["refused"] >= refused + 2
        # training on rows in RAM goes on (it moves nothing to disk)
        some = hot[:32]
        looked = await table.lookup(some)
        np.testing.assert_array_equal(looked, rows[np.isin(ids, some)])
        await opt.apply_gradients([(pstrain.IndexedSlices(_grad(looked, some), some), table)])
        ids, rows = await table.export()
        assert not np.array_equal(rows[np.isin(ids, some)], looked)
        np.testing.assert_array_equal(await table.lookup(cold, training=False), rows[np.isin(ids, cold)])
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_rows, rows)
        path = await pstrain.Checkpoint(model={"emb": table}, optimizer=opt).save(str(tmp_path / "full"))
        np.testing.assert_array_equal(pstrain.checkpoint.load_variables(path)["model/emb/rows"], rows)
        monkeypatch.undo()
        again = cold[:64]  # room again: the same lookup trains
        looked = await table.lookup(again)
        await opt.apply_gradients([(pstrain.IndexedSlices(_grad(looked, again), again), table)])
        assert not np.array_equal(
            await table.lookup(cold[:64], training=False), rows[np.isin(ids, cold[:64])]
        )


async def test_gradients_for_one_table_given_twice_in_a_step_train_as_in_ram(tmp_path):
    # apply_gradients given the same table twice (two IndexedSlices, say for two features
    # sharing it) sends each ps one request naming the table twice: the ps applies them one
    # after the other, as a ps holding everything in RAM does. On a tiered ps, bringing
    # back the second part's rows from disk may move the first part's out: each part must
    # still update its own rows, never another's (found by differential fuzzing: the
    # second part's gradient landed on the first part's rows). Each step also gives a new
    # variable its first gradient: its optimizer slot takes RAM from the table's hot set,
    # which keeps the rows of both parts.
    batches = _batches()
    rng = np.random.default_rng(3)
    dense_rows = 2048  # 128 KiB, and as much for its slot

    async def run(cluster: InProcessCluster) -> tuple[np.ndarray, np.ndarray]:
        strategy, table, opt = await _trained(cluster, batches)
        for step in range(4):  # rows mostly on disk, not looked up since (their keys old)
            with strategy.scope():
                dense = pstrain.Variable(np.zeros((dense_rows, DIM), np.float32), name=f"dense{step}")
            # (no compaction under way: one that moves a record the stage read makes the
            # handler read it again, on the loop)
            await wait_for(
                lambda: not any(getattr(ps.tables["emb"], "compacting", False) for ps in cluster.ps),
                30,
                "compactions",
            )
            ids = rng.permutation(IDS)[: 2 * BATCH].astype(np.int64)
            grads = np.tanh(np.cos(ids)[:, None] * np.arange(1, DIM + 1)).astype(np.float32)
            await opt.apply_gradients(
                [
                    (pstrain.IndexedSlices(grads[:BATCH], ids[:BATCH]), table),
                    (pstrain.IndexedSlices(grads[BATCH:], ids[BATCH:]), table),
                    (np.ones((dense_rows, DIM), np.float32), dense),
                ]
            )
        return await table.export()

    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        want_ids, want_rows = await run(ram)
    rng = np.random.default_rng(3)
    async with _tiered(tmp_path) as cluster:
        got_ids, got_rows = await run(cluster)
        promoted = sum(ps.tables["emb"].statistics()["promoted"] for ps in cluster.ps)
        loop_reads = [ps.tables["emb"].loop_reads for ps in cluster.ps]
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_rows, want_rows)  # bit for bit
    # and the stage brought every row of both parts back before the handler ran
    assert promoted > 0 and loop_reads == [0, 0]


async def test_tables_on_one_tiered_ps_share_its_ram_and_train_as_in_ram(tmp_path):
    """A table made after another has filled each ps's budget gets RAM from it (the first
    moves rows to disk and makes its arrays smaller), and both train exactly as on ps that
    keep everything in RAM; each ps stays within its budget."""
    batches = _batches()[:STEPS]  # (the skewed ones: with the even sweeps, two tables pass the budget)

    async def run(cluster: InProcessCluster) -> list[tuple[np.ndarray, np.ndarray]]:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            first = pstrain.DynamicEmbedding(DIM, name="first")
            opt = pstrain.optimizers.Adagrad(0.1)
        for ids in batches:  # fills the budget: most of it on disk
            await opt.apply_gradients(
                [(pstrain.IndexedSlices(_grad(await first.lookup(ids), ids), ids), first)]
            )
        with strategy.scope():
            second = pstrain.DynamicEmbedding(DIM, name="second")
        for ids in batches[:8]:  # both, in turn
            for table in (second, first):
                rows = await table.lookup(ids)
                await opt.apply_gradients([(pstrain.IndexedSlices(_grad(rows, ids), ids), table)])
        return [await t.export() for t in (first, second)]

    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        want = await run(ram)
    async with _tiered(tmp_path) as cluster:
        got = await run(cluster)
        for ps in cluster.ps:
            assert ps.table_handlers.held() <= BUDGET
            assert ps.tables["second"].alloc > 0 and len(ps.tables["first"].cold) > 0
    for (got_ids, got_rows), (want_ids, want_rows) in zip(got, want):
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)


async def test_sightings_of_ids_seen_once_give_way_to_the_rows_of_every_table(tmp_path):
    """A table that admits ids at their second sighting is fed ids seen once, step after
    step, beside a table that admits all: the sightings it remembers would outgrow the
    budget, so the oldest are forgotten and the ps refuses nothing; the other table trains
    exactly as on ps that keep everything in RAM, and each ps stays within its budget."""
    rng = np.random.default_rng(3)
    steps = [
        (np.unique(rng.integers(0, 1 << 50, 2000)), np.unique(rng.zipf(1.2, 512) % IDS).astype(np.int64))
        for _ in range(40)
    ]

    async def run(cluster: InProcessCluster) -> tuple[dict, tuple[np.ndarray, np.ndarray]]:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            admits = pstrain.DynamicEmbedding(DIM, name="admits", admit_after=2)
            plain = pstrain.DynamicEmbedding(DIM, name="plain")
            opt = pstrain.optimizers.Adagrad(0.1)
        for once, ids in steps:
            seen = await admits.lookup(once)
            rows = await plain.lookup(ids)
            await opt.apply_gradients(
                [
                    (pstrain.IndexedSlices(_grad(seen, once), once), admits),
                    (pstrain.IndexedSlices(_grad(rows, ids), ids), plain),
                ]
            )
        return await admits.statistics(), await plain.export()

    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        _, want = await run(ram)
    async with _tiered(tmp_path) as cluster:
        stats, got = await run(cluster)
        for ps in cluster.ps:
            assert ps.table_handlers.held() <= BUDGET
    assert stats["rows"] == 0 and stats["refused"] == 0 and stats["sightings_shed"] > 0, stats
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _grad(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return np.tanh(rows + np.sin(ids)[:, None]).astype(np.float32)


async def test_a_batch_that_cannot_fit_the_budget_is_refused_and_changes_nothing(tmp_path):
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
        await table.lookup(np.arange(1000))
        before = await table.export()
        with pytest.raises(ResourceExhaustedError, match="memory-budget"):
            await table.lookup(np.arange(10_000, 10_000 + 200_000))
        after = await table.export()
        np.testing.assert_array_equal(before[0], after[0])
        np.testing.assert_array_equal(before[1], after[1])
        assert (await table.statistics())["refused"] >= 1


async def test_a_table_full_for_large_batches_says_smaller_ones_fit_more_and_they_do(tmp_path):
    # A request's rows must fit in RAM twice over, so large batches keep a hot set that
    # small ones would give to the index of the rows on disk. The refusal says so, with
    # the figures, and the same table then takes more rows in smaller batches.
    budget, big, small = 4 << 20, 4096, 512
    options = {"memory_budget": budget, "table_dir": str(tmp_path / "tier"), "checkpoint_root": str(tmp_path)}
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)

        async def train(ids: np.ndarray) -> None:
            rows = await table.lookup(ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(_grad(rows, ids), ids), table)])

        made = 0
        with pytest.raises(ResourceExhaustedError) as refused:
            for _ in range(budget // 16):  # (far more rows than the budget can index)
                await train(np.arange(made, made + big, dtype=np.int64))
                made += big
        shard = cluster.ps[0].tables["emb"]
        message = str(refused.value)
        assert f"send smaller batches (the rows in RAM keep room for twice a request's {big}" in message
        assert f"{shard.alloc} rows are in RAM where {shard.hot_floor()} would do" in message
        assert len(shard) == made  # the refused batch changed nothing
        more = 6 * big  # (about a third as many again: 31,744 fit here)
        for lo in range(made, made + more, small):
            await train(np.arange(lo, lo + small, dtype=np.int64))
        assert len(shard) == made + more and shard.alloc < 2 * big
        assert cluster.ps[0].table_handlers.held() <= budget


async def test_a_fixed_variable_past_the_budget_is_refused_and_the_ps_holds_nothing_of_it(tmp_path):
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():  # 2 MiB on one ps of a 1 MiB budget
            big = pstrain.Variable(np.zeros((BUDGET // 32, 16), np.float32), name="big")
        with pytest.raises(ResourceExhaustedError, match="memory budget.*DynamicEmbedding"):
            await big.read_value()
        assert all("big" not in ps.store for ps in cluster.ps)
        with strategy.scope():  # one that fits is made as ever
            small = pstrain.Variable(np.ones((BUDGET // 256, 16), np.float32), name="small")
        np.testing.assert_array_equal(await small.read_value(), np.ones((BUDGET // 256, 16)))


async def test_a_ps_keeps_a_sixteenth_of_its_budget_for_requests_in_flight(tmp_path):
    """Its variables and tables hold at most 15/16 of ``--memory-budget``: a variable that
    would fit the whole budget but not that is refused, naming both; one within it is made;
    a table filled past the budget stays within it too."""
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():  # 31/32 of the budget
            big = pstrain.Variable(np.zeros((BUDGET * 31 // 32 // 64, 16), np.float32), name="big")
        says = f"memory budget of {BUDGET} bytes.*may hold {BUDGET * 15 // 16}"
        with pytest.raises(ResourceExhaustedError, match=says):
            await big.read_value()
        assert all("big" not in ps.store for ps in cluster.ps)
        with strategy.scope():  # 7/8 of it is made
            fits = pstrain.Variable(np.ones((BUDGET * 7 // 8 // 64, 16), np.float32), name="fits")
        assert float((await fits.read_value()).sum()) == BUDGET * 7 // 8 // 4
    (tmp_path / "again").mkdir()
    async with _tiered(tmp_path / "again") as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
        for k in range(FILL_BATCHES // 2):
            await table.lookup(np.arange(512 * k, 512 * k + 512))
        stats = await table.statistics()
        assert stats["cold_rows"] > stats["hot_rows"] > 0
        for ps in cluster.ps:
            assert 0 < ps.table_handlers.held() <= BUDGET * 15 // 16


async def test_a_new_coordinator_takes_over_a_variable_of_over_half_the_budget(tmp_path):
    value = np.ones((BUDGET // 96, 16), np.float32)  # 2/3 of the budget: twice would not fit
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            w = pstrain.Variable(value, name="w")
        await w.read_value()
        del w, strategy
        gc.collect()  # the coordinator is gone (killed: nothing closed), and another starts
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            w = pstrain.Variable(2 * value, name="w")
        assert w.key == "w"  # the same name: the dead one's variable is taken over
        np.testing.assert_array_equal(await w.read_value(), 2 * value)


async def test_a_variable_of_over_half_the_budget_restores_in_place(tmp_path):
    value = np.arange(BUDGET // 96 * 16, dtype=np.float32).reshape(-1, 16)  # 2/3 of the budget
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            w = pstrain.Variable(value, name="w")
        path = await pstrain.Checkpoint(w=w).save(str(tmp_path / "c"))
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():  # its initial values give their memory to the values read
            w = pstrain.Variable(pstrain.initializers.Zeros(), shape=value.shape, dtype="float32", name="w")
        (await pstrain.Checkpoint(w=w).restore(path)).assert_consumed()
        np.testing.assert_array_equal(await w.read_value(), value)


async def test_optimizer_slots_past_the_budget_are_refused_and_change_nothing(tmp_path):
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        value = np.full((BUDGET // 128, 16), 0.5, np.float32)  # 512 KiB: its Adagrad slot too
        with strategy.scope():
            w = pstrain.Variable(value, name="w")
            opt = pstrain.optimizers.Adagrad(0.1)
            sgd = pstrain.optimizers.SGD(0.5)  # no slots
        grad = np.ones_like(value)
        with pytest.raises(ResourceExhaustedError, match="optimizer slots.*memory budget"):
            await opt.apply_gradients([(grad, w)])
        np.testing.assert_array_equal(await w.read_value(), value)
        held = [ps.store.nbytes for ps in cluster.ps]
        assert sorted(held)[-1] < BUDGET, held  # no slot was made
        await sgd.apply_gradients([(grad, w)])
        np.testing.assert_array_equal(await w.read_value(), value - 0.5)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
async def test_a_table_that_filled_the_budget_gives_ram_to_new_variables_and_slots(tmp_path, eviction):
    # The table fills each ps's budget first; a dense variable and its Adagrad slot made
    # after that get RAM from the table's hot set (its coldest rows go to disk), not a
    # refusal. The slot comes with an update of rows just looked up, among the coldest by
    # count (LFU): they stay in RAM for the update. The table trains on as on ps holding
    # everything in RAM.
    batches = [np.arange(k * BATCH, (k + 1) * BATCH, dtype=np.int64) * 7919 + 5 for k in range(FILLED + 3)]
    value = np.full((BUDGET // 512, 16), 0.5, np.float32)  # 128 KiB, and as much for its slot

    async def run(cluster: InProcessCluster, check=None):
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb", eviction=eviction)
            opt = pstrain.optimizers.Adagrad(0.1)
        for ids in batches[:FILLED]:
            await opt.apply_gradients(
                [(pstrain.IndexedSlices(_grad(await table.lookup(ids), ids), ids), table)]
            )
        if check:
            check()
        with strategy.scope():
            w = pstrain.Variable(value, name="w")
        for ids in batches[FILLED:]:  # the variable's first update makes its slot
            rows = await table.lookup(ids)
            await opt.apply_gradients(
                [(np.ones_like(value), w), (pstrain.IndexedSlices(_grad(rows, ids), ids), table)]
            )
        return await w.read_value(), await table.export()

    def full() -> None:  # no room for the variable and its slot beside the table as it is
        for ps in cluster.ps:
            assert ps.table_handlers.held() > BUDGET - 2 * value.nbytes

    async with _tiered(tmp_path) as cluster:
        got_w, (got_ids, got_rows) = await run(cluster, full)
        for ps in cluster.ps:
            assert ps.table_handlers.held() <= BUDGET
            assert ps.tables["emb"].loop_reads == 0  # the update's rows stayed in RAM
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        want_w, (want_ids, want_rows) = await run(ram)
    np.testing.assert_array_equal(got_w, want_w)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_rows, want_rows)


async def test_a_variable_that_comes_during_a_save_is_refused_saying_so_and_fits_after(tmp_path):
    # While a save reads the table its rows in RAM stay where the save's snapshots find
    # them, so a variable the budget has no room for then is refused, and the refusal says
    # why; once the save ends, the table gives it RAM.
    batches = [np.arange(k * BATCH, (k + 1) * BATCH, dtype=np.int64) * 7919 + 5 for k in range(FILLED)]
    value = np.full((BUDGET // 256, 16), 0.5, np.float32)  # 256 KiB: past what the table leaves
    async with _tiered(tmp_path) as cluster:
        table, _ = await _train(cluster, batches)
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        shards = [ps.tables["emb"] for ps in cluster.ps]
        saves = [shard.snapshot() for shard in shards]  # as a save takes each shard
        with strategy.scope():
            w = pstrain.Variable(value, name="w")
        with pytest.raises(ResourceExhaustedError, match=r"a save is reading tables \['emb'\]"):
            await w.read_value()
        assert all("w" not in ps.store for ps in cluster.ps)
        for shard, save in zip(shards, saves):
            shard.end_snapshot(save)
        with strategy.scope():
            w = pstrain.Variable(value, name="w")
        np.testing.assert_array_equal(await w.read_value(), value)
        for ps in cluster.ps:
            assert ps.table_handlers.held() <= BUDGET


async def test_a_ps_needs_both_a_budget_and_a_directory(tmp_path):
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="both memory_budget and table_dir"):
        async with InProcessCluster(num_ps=1, num_workers=1, ps_options={"memory_budget": BUDGET}):
            pass


async def test_a_table_filled_past_what_half_the_budget_indexes_takes_ram_from_its_hot_set(tmp_path):
    # Unseen ids, batch after batch: the index of the rows on disk fills its half of each
    # ps's budget, then the hot set gives it RAM (each ps's stage, before the request), so
    # the table keeps taking rows; it trains as on ps holding everything in RAM, and each
    # ps stays within its budget.
    rng = np.random.default_rng(11)
    batches = []
    for k in range(FILL_BATCHES):
        new = np.arange(k * BATCH, (k + 1) * BATCH, dtype=np.int64) * 7919 + 5
        old = rng.choice(max(1, k * BATCH), BATCH // 4).astype(np.int64) * 7919 + 5
        batches.append(np.unique(np.concatenate([new, old])))
    async with _tiered(tmp_path) as cluster:
        table, _ = await _train(cluster, batches)
        got_ids, got_rows = await table.export()
        stats = await table.statistics()
        assert stats["refused"] == 0 and stats["rows"] == FILL_BATCHES * BATCH, stats
        for ps in cluster.ps:
            shard = ps.tables["emb"]
            assert shard.shrunk > 0 and ps.table_handlers.held() <= BUDGET
            assert shard.cold.nbytes > BUDGET // 2  # more than its own half
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as ram:
        table, _ = await _train(ram, batches)
        want_ids, want_rows = await table.export()
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_rows, want_rows)


async def test_a_tiered_restore_of_a_base_and_deltas_reads_the_base_as_it_writes_it(tmp_path):
    """A tiered shard restored from a base and deltas (rows put, evicted, put again, and the
    base's own) holds every row, slot and id as the table did, read a piece at a time from
    the base (its rows never whole in RAM); a base damaged where its rows lie is refused
    whole, and the table restored before stays as it was."""
    async with _tiered(tmp_path) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb", capacity=9_000, eviction="lru")
            opt = pstrain.optimizers.Adagrad(0.1)
        batches = _batches()

        async def train(some):
            await train_with(table, opt, some)

        manager = pstrain.CheckpointManager(
            pstrain.Checkpoint(model={"emb": table}, optimizer=opt), str(tmp_path / "chain"), max_to_keep=None
        )
        await train(batches[:10])
        await manager.save()
        last = ""
        for k in range(10, len(batches), 4):  # evictions past the capacity: removed ids in deltas
            await train(batches[k : k + 4])
            last = await manager.save_delta()
        await manager.close()
        want_ids, want_rows = await table.export()
        assert (await table.statistics())["evicted"] > 0
        with strategy.scope():
            fresh = pstrain.DynamicEmbedding(DIM, name="emb", capacity=9_000, eviction="lru")
            opt2 = pstrain.optimizers.Adagrad(0.1)
        await pstrain.Checkpoint(model={"emb": fresh}, optimizer=opt2).restore(last)
        got_ids, got_rows = await fresh.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)
        assert (await fresh.statistics())["cold_rows"] > 0
        # steps after the restore update rows and accumulators alike: the slots came back too
        await train_with(fresh, opt2, batches[-2:])
        with strategy.scope():
            again = pstrain.DynamicEmbedding(DIM, name="emb", capacity=9_000, eviction="lru")
            opt3 = pstrain.optimizers.Adagrad(0.1)
        await pstrain.Checkpoint(model={"emb": again}, optimizer=opt3).restore(last)
        await train_with(again, opt3, batches[-2:])
        np.testing.assert_array_equal((await again.export())[1], (await fresh.export())[1])
        # a base damaged where its rows lie: refused whole, the restored table as it was
        base = max(
            (p for p in (tmp_path / "chain").rglob("*") if p.is_file() and p.stat().st_size > 1 << 16),
            key=lambda p: p.stat().st_size,
        )
        data = bytearray(base.read_bytes())
        data[-100] ^= 0xFF
        base.write_bytes(bytes(data))
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="checksum|damaged|digest"):
            await pstrain.Checkpoint(model={"emb": again}, optimizer=opt3).restore(last)
        np.testing.assert_array_equal((await again.export())[1], (await fresh.export())[1])


async def train_with(table, opt, some) -> None:
    for ids in some:
        rows = await table.lookup(ids)
        grad = np.tanh(rows + np.sin(ids)[:, None]).astype(np.float32)
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])


def _ranking_model(budgeted: bool):
    """W8's shape in small: a dynamic table two features share (one weighted), others with
    their own combiner and optimizer, and a small fixed table."""
    from pstrain import EmbeddingCollection, TableConfig

    collection = EmbeddingCollection(
        [
            TableConfig("user", None, 16, ["clicks", "views"]),
            TableConfig("item", None, 8, ["item"], combiner="mean", optimizer=pstrain.optimizers.Ftrl(0.1)),
            TableConfig(
                "query",
                None,
                16,
                ["terms"],
                combiner="sqrtn",
                optimizer=pstrain.optimizers.RowWiseAdagrad(0.3, initial_accumulator_value=0.1),
            ),
            TableConfig(
                "small", 50, 4, ["cat"], initializer=pstrain.initializers.RandomUniform(-0.05, 0.05, seed=1)
            ),
        ]
    )
    return collection, pstrain.optimizers.Adagrad(0.2, initial_accumulator_value=0.1)


def _ranking_batches(steps: int = 30, bags: int = 256, ids: int = 60_000) -> list[dict]:
    from pstrain import JaggedTensor

    rng = np.random.default_rng(3)
    out = []
    for _ in range(steps):
        features = {}
        for name in ("clicks", "views", "item", "terms"):
            lengths = rng.integers(0, 6, bags)  # empty bags among them
            n = int(lengths.sum())
            values = (rng.zipf(1.15, n) * 7919 + rng.integers(0, 3, n)) % ids
            weights = rng.uniform(0.5, 2, n).astype(np.float32) if name == "views" else None
            features[name] = JaggedTensor(values, lengths, weights=weights)
        features["cat"] = JaggedTensor(rng.integers(0, 50, bags), np.ones(bags, np.int64))
        out.append(features)
    return out


async def test_a_ranking_models_tables_on_tiered_ps_train_save_and_restore_as_in_ram(tmp_path):
    """An EmbeddingCollection (issue 61's models) on ps with a budget: its dynamic tables
    spill to disk, and every pooled output, row and restore is bit for bit the in-RAM run's,
    with the restore linking the checkpoint's files into the tier."""
    batches = _ranking_batches()
    probe = np.arange(60_000, dtype=np.int64)

    async def run(cluster, prefix: str, restore: str | None = None):
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            collection, opt = _ranking_model(True)
        linked = 0
        if restore:
            await pstrain.Checkpoint(model=collection, optimizer=opt).restore(restore)
            linked = sum(  # the base's files linked in, on tiered ps
                name.endswith(".ref")
                for ps in cluster.ps
                if ps.table_handlers.tiering is not None
                for table in ps.tables.values()
                if getattr(table, "cold", None) is not None
                for name in os.listdir(table.cold.directory)
            )
        pooled_all = []
        for features in batches:
            pooled = await collection.lookup(features)
            out = pooled.concat()
            pooled_all.append(out.copy())
            await collection.apply_gradients(pooled.gradients(np.tanh(out)), opt)
        path = await pstrain.Checkpoint(model=collection, optimizer=opt).save(str(tmp_path / prefix))
        rows = {"small": await collection.tables["small"].numpy()}
        for name in ("user", "item", "query"):  # (a thousand at a time: each read fits the hot set)
            parts = [probe[lo : lo + 1000] for lo in range(0, probe.size, 1000)]
            rows[name] = np.concatenate(
                [await collection.tables[name].lookup(p, training=False) for p in parts]
            )
        stats = {n: await collection.tables[n].statistics() for n in ("user", "item", "query")}
        return pooled_all, rows, path, dict(stats, linked=linked)

    def tiered(directory: str) -> InProcessCluster:
        options = {
            "memory_budget": 2 << 20,
            "table_dir": str(tmp_path / directory),
            "checkpoint_root": str(tmp_path),
            "table_segment_rows": 256,
        }
        return InProcessCluster(num_ps=2, num_workers=1, token=TOKEN, ps_options=options)

    def in_ram() -> InProcessCluster:
        return InProcessCluster(
            num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
        )

    async with in_ram() as cluster:
        want_pooled, want_rows, ram_path, _ = await run(cluster, "ram")
    async with tiered("tier") as cluster:
        pooled, rows, tiered_path, stats = await run(cluster, "tiered")
        for ps in cluster.ps:
            assert ps.table_handlers.held() <= 2 << 20
    del stats["linked"]
    assert all(s["cold_rows"] > s["hot_rows"] / 2 and s["refused"] == 0 for s in stats.values()), stats
    for got, want in zip(pooled, want_pooled):
        np.testing.assert_array_equal(got, want)
    for name, want in want_rows.items():
        np.testing.assert_array_equal(rows[name], want, err_msg=name)
    # each restored and trained again: the tiered checkpoint onto tiered ps (its base files
    # linked into the tier), the in-RAM one onto ps holding it all
    async with in_ram() as cluster:
        want_pooled, want_rows, _, _ = await run(cluster, "ram2", restore=ram_path)
    async with tiered("tier2") as cluster:
        pooled, rows, _, stats = await run(cluster, "tiered2", restore=tiered_path)
    assert stats.pop("linked") > 0
    assert sum(s["cold_rows"] for s in stats.values()) > 0, stats
    for got, want in zip(pooled, want_pooled):
        np.testing.assert_array_equal(got, want)
    for name, want in want_rows.items():
        np.testing.assert_array_equal(rows[name], want, err_msg=name)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"memory_budget": -1}, "memory_budget must be a whole number of 1 or more, got -1"),
        ({"memory_budget": "lots"}, "memory_budget must be a size in bytes such as 512MiB, got 'lots'"),
        ({"memory_budget": 1.5e6}, "memory_budget must be a whole number of 1 or more, got 1500000.0"),
        ({"table_segment_rows": 0}, "table_segment_rows must be a whole number of 1 or more, got 0"),
        ({"table_dir": 123}, "table_dir must be a directory's path, got 123"),
        ({"table_dir": "/proc/pstrain-tier"}, "table_dir '/proc/pstrain-tier': this ps cannot keep its"),
        ({"max_store_bytes": 0}, "max_store_bytes must be a whole number of 1 or more, got 0"),
    ],
)
async def test_a_ps_given_a_budget_or_tier_it_cannot_use_is_refused_naming_it(tmp_path, options, message):
    options = {"memory_budget": BUDGET, "table_dir": str(tmp_path / "tier")} | options
    with pytest.raises(pstrain.errors.InvalidArgumentError, match=re.escape(message)):
        async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options):
            pass
    assert not (tmp_path / "tier").exists() or not os.listdir(tmp_path / "tier")


async def test_a_budget_given_as_a_size_is_the_budget_in_bytes(tmp_path):
    """``memory_budget="1MiB"`` (as ``LocalCluster`` and ``--memory-budget`` take it) tiers the
    table as ``1 << 20`` does: the same rows on disk after the same training."""
    held = []
    for budget in ("1MiB", BUDGET):
        options = {"memory_budget": budget, "table_dir": str(tmp_path / f"tier{len(held)}")}
        async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options) as cluster:
            table, _ = await _train(cluster, _batches()[:8])
            stats = await table.statistics()
            held.append((stats["hot_rows"], stats["cold_rows"]))
    assert held[0] == held[1] and held[0][1] > 0, held
