"""The serving feed (``GET /v1/tables/<name>/rows?since=``) on real ps: a reader following
it with the example consumer holds exactly the table's rows at each saved version, through
deltas, a compaction (no full read) and a restart of the whole job (versions kept)."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, table_feed_example

pytestmark = pytest.mark.timeout(90)

DIM = 4
table_feed = table_feed_example()


def _model(strategy):
    with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="emb", capacity=40)
        opt = pstrain.optimizers.Adagrad(0.1)
    return table, opt, pstrain.Checkpoint(model={"emb": table}, optimizer=opt)


def _cluster(root: str, num_ps: int = 2) -> InProcessCluster:
    """Real in-process ps that may write under ``root``, and one worker."""
    return InProcessCluster(num_ps=num_ps, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root})


async def _step(table, opt, k: int) -> None:
    ids = np.arange(7 * k, 7 * k + 9, dtype=np.int64)  # past capacity 40: evictions
    await table.lookup(ids)
    await opt.apply_gradients(
        [(pstrain.IndexedSlices(np.full((ids.size, DIM), 0.1 * (k + 1), np.float32), ids), table)]
    )


async def _same(mirror, table) -> None:
    ids, rows = await table.export()
    got_ids, got_rows = mirror.snapshot()
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_rows, rows)


async def test_a_table_created_in_the_scope_answers_412_until_its_first_save(tmp_path):
    """As the docs say: a table created (``async with strategy.scope()`` creates it on every
    ps) but not yet saved is 412 on every ps, and a name no ps knows is 404."""
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as session:
            for ps in cluster.ps:
                async with session.get(f"http://{ps.address}/v1/tables/emb/rows", headers=auth) as r:
                    body = await r.json()
                    assert r.status == 412 and "not been saved" in body["error"]["message"]
                async with session.get(f"http://{ps.address}/v1/tables/other/rows", headers=auth) as r:
                    assert r.status == 404
            manager = pstrain.checkpoint.CheckpointManager(pstrain.Checkpoint(emb=table), root)
            await manager.save()
            for ps in cluster.ps:
                async with session.get(f"http://{ps.address}/v1/tables/emb/rows", headers=auth) as r:
                    assert r.status == 200 and r.headers["X-Pstrain-Reset"] == "true"


async def test_a_reader_follows_deltas_a_compaction_and_a_restart(tmp_path):
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, deltas_per_base=100)
        endpoints = [ps.address for ps in cluster.ps]
        mirror = table_feed.TableMirror(endpoints, "emb", TOKEN)
        url = f"http://{endpoints[0]}/v1/tables/emb/rows"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers=auth) as r:  # not created on the ps yet
                assert r.status == 404 and "not created here yet" in (await r.json())["error"]["message"]
            await _step(table, opt, 0)
            async with session.get(url, headers=auth) as r:  # nothing saved yet
                assert r.status == 412 and "not been saved" in (await r.json())["error"]["message"]
            await manager.save()
            assert await mirror.poll(session) > 0 and mirror.resets == 2  # first: whole shards
            await _same(mirror, table)
            for k in range(1, 4):
                await _step(table, opt, k)
                await manager.save_delta()
                assert await mirror.poll(session) <= 2 * 9  # only the rows the step changed
                await _same(mirror, table)
            assert mirror.resets == 2
            assert await mirror.poll(session) == 0  # the same version again: nothing
            # A compaction: the reader goes on from the new base's deltas, no full read.
            await _step(table, opt, 4)
            base = await manager.compact()
            await _step(table, opt, 5)
            await manager.save_delta()
            assert manager.checkpoints[-1] == base
            await mirror.poll(session)
            await _same(mirror, table)
            assert mirror.resets == 2
            # Bad requests change nothing and say what was wrong.
            async with session.get(url) as r:
                assert r.status == 401
            async with session.get(url, params={"since": "x1"}, headers=auth) as r:
                assert r.status == 400 and "since='x1'" in (await r.json())["error"]["message"]
            async with session.get(url, params={"since": "1", "limit": "2"}, headers=auth) as r:
                assert r.status == 400 and "limit" in (await r.json())["error"]["message"]
            async with session.get(url.replace("emb", "nope"), headers=auth) as r:
                assert r.status == 404
            async with session.get(url, params={"since": "999999"}, headers=auth) as r:
                assert r.status == 200 and r.headers["X-Pstrain-Reset"] == "true"
        versions = [s.version for s in mirror.shards]
        expected = await table.export()

    # The whole job restarts: the restored ps answer for the same versions.
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, deltas_per_base=100)
        await manager.restore_or_initialize()
        mirror.endpoints = [ps.address for ps in cluster.ps]
        async with aiohttp.ClientSession() as session:
            assert await mirror.poll(session) == 0 and [s.version for s in mirror.shards] == versions
            np.testing.assert_array_equal(mirror.snapshot()[0], expected[0])
            await _step(table, opt, 6)
            await manager.save_delta()
            assert 0 < await mirror.poll(session) <= 9
            await _same(mirror, table)
            assert mirror.resets == 2


async def test_a_reader_drops_a_lost_ps_once_the_others_hold_its_slices_and_holds_each_row_once(tmp_path):
    root = str(tmp_path)
    async with _cluster(root, 3) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        table, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, deltas_per_base=100)
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "emb", TOKEN)
        async with aiohttp.ClientSession() as session:
            await _step(table, opt, 0)
            await manager.save()
            await _step(table, opt, 1)
            await manager.save_delta()
            await mirror.poll(session)
            await _same(mirror, table)
            await cluster.ps[1].stop()  # lost: its copy in the mirror is all a reader has of it
            await mirror.poll(session)
            assert mirror.shards[1] is not None and mirror.shards[1].down
            await coordinator.replace_ps(1, manager)  # its slices, from the delta, onto 0 and 2
            await _step(table, opt, 2)
            await manager.save_delta()
            await mirror.poll(session)
            assert mirror.shards[1] is None  # the others hold every slice now: dropped
            await _same(mirror, table)  # each row once, as the table has it
            ids, _ = mirror.snapshot()
            assert np.unique(ids).size == ids.size
        await coordinator.close()


async def test_a_reply_whose_saves_are_pruned_before_it_opens_them_reads_the_newer_ones(
    tmp_path, monkeypatch
):
    """A save pruned between the feed's listing of the saves and its opening of their files
    (a reader polling while ``max_to_keep`` prunes): the feed lists them again and serves
    the newest version, never a 404 for a file it was about to read."""
    from pstrain._formats.files import table_feed as feed_files

    root = str(tmp_path)
    async with _cluster(root, 1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, str(tmp_path / "ckpt"), max_to_keep=1)
        await _step(table, opt, 0)
        await manager.save()
        feed = cluster.ps[0].feed
        directory = feed.directories["emb"]
        stale = feed_files._saves(directory, "emb", feed.index, {}, feed.confine)  # ckpt-1 only
        for k in (1, 2):  # ckpt-1 pruned
            await _step(table, opt, k)
            await manager.save()
        assert not any(p.name.startswith("ckpt-1.") for p in (tmp_path / "ckpt").iterdir())
        listings = []
        real = feed_files._saves

        def listed(*args):
            listings.append(args)
            return stale if len(listings) == 1 else real(*args)

        monkeypatch.setattr(feed_files, "_saves", listed)
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "emb", TOKEN)
        async with aiohttp.ClientSession() as session:
            await mirror.poll(session)
        assert len(listings) == 2  # the stale listing, then the directory read again
        await _same(mirror, table)
        await manager.close()


async def test_a_collections_dynamic_table_is_followed_by_its_name_slash_and_all(tmp_path):
    """A collection names its tables ``<collection>/<table>``: the feed serves
    ``/v1/tables/embeddings/ids/rows`` (and the same with the slash escaped), and the example
    reader follows it by that name."""
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            collection = pstrain.EmbeddingCollection([pstrain.TableConfig("ids", None, DIM, ["f"])])
            opt = pstrain.optimizers.Adagrad(0.1)
        batch = pstrain.KeyedJaggedTensor(["f"], np.arange(30), np.ones(30, np.int64))
        pooled = await collection.lookup(batch)
        await collection.apply_gradients(pooled.gradients(np.ones((30, DIM), np.float32)), opt)
        manager = pstrain.checkpoint.CheckpointManager(
            pstrain.Checkpoint(model=collection, optimizer=opt), str(tmp_path / "ckpt")
        )
        await manager.save()
        table = collection.tables["ids"]
        assert table.name == "embeddings/ids"
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], table.name, TOKEN)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as session:
            assert await mirror.poll(session) == 30
            for path in ("embeddings/ids", "embeddings%2Fids"):
                url = f"http://{cluster.ps[0].address}/v1/tables/{path}/rows"
                async with session.get(url, headers=auth) as r:
                    assert r.status == 200 and r.headers["X-Pstrain-Version"], path
                    await r.read()
        await _same(mirror, table)
        await manager.close()


async def test_a_damaged_index_is_not_a_version_and_the_log_says_so(tmp_path, caplog):
    """A delta whose index is damaged (a bit flipped: its digest does not match) is not a
    version: the feed serves the last save before it, whole (a reader that had the
    damaged one gets that state back, its version named), and the ps's log names the file
    once."""
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, deltas_per_base=100)
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "emb", TOKEN)
        await _step(table, opt, 0)
        await manager.save()
        await _step(table, opt, 1)
        await manager.save_delta()
        first = await table.export()
        async with aiohttp.ClientSession() as session:
            await mirror.poll(session)
            version = mirror.shards[0].version
            await _step(table, opt, 2)
            damaged = await manager.save_delta()
            with open(damaged + ".index.json", "r+b") as f:
                text = f.read()
                at = text.index(b'"seq"') + 5
                while not chr(text[at]).isdigit():
                    at += 1
                f.seek(at)
                f.write(bytes([text[at] ^ 1]))
            with caplog.at_level("WARNING", logger="pstrain"):
                assert await mirror.poll(session) == 0  # nothing newer than what it has
                assert await mirror.poll(session) == 0
        assert [s.version for s in mirror.shards] == [version, version]
        np.testing.assert_array_equal(mirror.snapshot()[0], first[0])
        np.testing.assert_array_equal(mirror.snapshot()[1], first[1])
        said = [r for r in caplog.records if "is not a version" in r.getMessage()]
        assert len(said) == 2 and all(damaged in r.getMessage() for r in said)  # once on each ps
        await manager.close()
