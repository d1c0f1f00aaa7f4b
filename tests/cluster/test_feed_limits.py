"""The serving feed under attack: it reads nothing outside the checkpoint root, its memory
follows the bytes it sends, not the readers who ask (a bounded number of replies at once,
503 with Retry-After past it; a reader that stops reading is dropped), and a query it
cannot take exactly as given is a 400 naming what was wrong."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import aiohttp
import numpy as np
import pytest

import pstrain
import pstrain._serving.http as http_adapter
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, rss, wait_for

pytestmark = pytest.mark.timeout(180)

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _saved_table(root: str, resolver, rows: int, dim: int = 4):
    strategy = pstrain.ParameterServerStrategy(resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(dim, name="emb", capacity=2 * rows)
    ckpt = pstrain.Checkpoint(model={"emb": table})
    manager = pstrain.checkpoint.CheckpointManager(ckpt, root, deltas_per_base=100)
    for lo in range(0, rows, 50_000):
        await table.lookup(np.arange(lo, min(rows, lo + 50_000), dtype=np.int64))
    await manager.save()
    return table, manager


async def test_a_table_file_linked_out_of_the_root_is_refused_not_served(tmp_path):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(root)}
    ) as cluster:
        table, manager = await _saved_table(str(root), cluster.resolver, 300)
        url = f"http://{cluster.ps[0].address}/v1/tables/emb/rows"
        async with aiohttp.ClientSession() as session:
            async with session.get(url, headers=AUTH) as r:
                assert r.status == 200 and int(r.headers["Content-Length"]) > 300 * 16
            # Every file the index names is swapped for a link to a copy outside the root.
            [index_path] = [p for p in root.iterdir() if p.name.endswith(".index.json")]
            entry = next(iter(json.loads(index_path.read_text())["tables"].values()))
            for name in entry["files"]:
                shutil.copy(root / name, outside / name)
                os.unlink(root / name)
                os.symlink(outside / name, root / name)
            async with session.get(url, headers=AUTH) as r:
                body = await r.json()
                assert r.status == 400, body
                assert "outside this ps's checkpoint root" in body["error"]["message"]
            # A link of the index itself, out of the root, is refused too.
            shutil.copy(index_path, outside / index_path.name)
            os.unlink(index_path)
            os.symlink(outside / index_path.name, index_path)
            async with session.get(url, headers=AUTH) as r:
                assert r.status == 400
                assert "outside" in (await r.json())["error"]["message"]


async def test_readers_at_once_are_bounded_and_a_reader_that_stops_reading_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(http_adapter, "SEND_TIMEOUT_S", 1.0)
    root = str(tmp_path)
    rows, dim = 120_000, 64  # about 31 MiB of rows: more than the sockets buffer
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as cluster:
        await _saved_table(root, cluster.resolver, rows, dim)
        feed = cluster.ps[0].feed
        host, port = cluster.ps[0].address.rsplit(":", 1)
        request = (
            f"GET /v1/tables/emb/rows?since=123456 HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n"
        ).encode()
        before = rss(os.getpid())
        stalled = []  # readers that ask for the whole shard and never read a byte
        for _ in range(feed.max_readers):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            stalled.append((reader, writer))
        await wait_for(lambda: feed.readers == feed.max_readers, 30, "every slot taken")
        async with aiohttp.ClientSession() as session:
            url = f"http://{cluster.ps[0].address}/v1/tables/emb/rows"
            async with session.get(url, headers=AUTH) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "most at once" in (await r.json())["error"]["message"]
            grown = rss(os.getpid()) - before
            # Each stalled reply holds its ids and a piece of rows, never the shard's rows.
            assert grown < rows * dim * 4, f"{grown >> 20} MiB held for {feed.max_readers} readers"
            # Past the send timeout, the stalled readers are dropped and their slots freed.
            await wait_for(lambda: feed.readers == 0, 30, "stalled readers dropped")
            async with session.get(url, headers=AUTH) as r:
                assert r.status == 200 and r.headers["X-Pstrain-Reset"] == "true"
                body = await r.read()
        for _, writer in stalled:
            writer.close()
        from safetensors.numpy import load

        got = load(body)
        assert got["ids"].size == rows and got["rows"].shape == (rows, dim)
        np.testing.assert_array_equal(np.sort(got["ids"]), np.arange(rows))


@pytest.mark.parametrize(
    "query, said",
    [
        ("since=1&since=2", "['since'] given more than once"),  # (one of them was taken)
        ("since=%D9%A3", "since='\u0663' is not a version"),  # an Arabic-Indic 3 (it was taken as 3)
        ("since=-1", "since='-1' is not a version"),
        ("since=1.5", "since='1.5' is not a version"),
        ("since=99999999999999999999", "is not a version"),
        ("since=1&limit=5", "unknown query parameter(s) ['limit']"),
    ],
)
async def test_a_query_the_feed_cannot_take_as_given_is_a_400_naming_it(tmp_path, query, said):
    root = str(tmp_path)
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as cluster:
        await _saved_table(root, cluster.resolver, rows=10)
        url = f"http://{cluster.ps[0].address}/v1/tables/emb/rows"
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}?{query}", headers=AUTH) as r:
                assert r.status == 400
                assert said in (await r.json())["error"]["message"]
            async with session.get(f"{url}?since=0", headers=AUTH) as r:
                assert r.status == 200  # the feed serves on
