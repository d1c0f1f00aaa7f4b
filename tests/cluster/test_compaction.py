"""Deltas go on while a full checkpoint is written (a compaction's base takes seconds on a
large model), and a new base becomes visible with its first delta, so the newest save is
never older than the deltas before it: what a SIGKILL loses stays about one interval
through a compaction too. Real in-process ps; the ps's full-save writer is held on an
event to make the full save last as long as the test needs."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain.server.ps.checkpoints.saves import _save_thread
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(90)

DIM = 4


def _cluster(root: str, num_ps: int = 2) -> InProcessCluster:
    return InProcessCluster(num_ps=num_ps, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root})


def _model(strategy):
    with strategy.scope():
        count = pstrain.Variable(np.zeros(1, np.float32), name="count")
        table = pstrain.DynamicEmbedding(DIM, name="emb", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
    return count, table, opt, pstrain.Checkpoint(model={"count": count, "emb": table}, optimizer=opt)


async def _step(count, table, opt, k: int) -> None:
    """Step ``k`` (from 1): count is k after it; id k gets row k."""
    ids = np.array([k], np.int64)
    await table.lookup(ids)
    await opt.apply_gradients(
        [
            (np.full(1, -1.0, np.float32), count),
            (pstrain.IndexedSlices(np.full((1, DIM), -float(k), np.float32), ids), table),
        ]
    )


def _count(path: str) -> int:
    return int(pstrain.checkpoint.load_variables(path)["model/count"][0])


async def _feed_version(session, address: str) -> int:
    async with session.get(
        f"http://{address}/v1/tables/emb/rows", headers={"Authorization": f"Bearer {TOKEN}"}
    ) as r:
        assert r.status == 200, await r.text()
        return int(r.headers["X-Pstrain-Version"])


def _seq(path: str) -> int:
    with open(path + ".index.json", encoding="utf-8") as f:
        return int(json.load(f)["seq"])


async def test_deltas_go_on_during_a_full_save_which_shows_up_with_its_first_delta(tmp_path):
    root = str(tmp_path)
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        count, table, opt, ckpt = _model(strategy)
        # Deltas on (a long interval: this test writes them itself), so saves catch up.
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, delta_interval_s=3600)
        await _step(count, table, opt, 1)
        first = await manager.save()
        assert manager.latest_checkpoint == first  # the first save: no delta with it

        gate = threading.Event()
        held = _save_thread("full").submit(gate.wait, 60)  # the ps's full writes wait behind it
        try:
            await _step(count, table, opt, 2)
            full = asyncio.create_task(manager.save())
            await _step(count, table, opt, 3)
            # A delta is written while the full save cannot finish ...
            delta = await asyncio.wait_for(manager.save_delta(), 30)
            assert delta == f"{first}.delta-1" and not full.done()
            assert manager.latest_checkpoint == delta and _count(delta) == 3
            await _step(count, table, opt, 4)
        finally:
            gate.set()
        held.result(timeout=30)
        second = await asyncio.wait_for(full, 30)
        # ... and the full save shows up with its own first delta: step 4, made while it was
        # written, is in the newest save, which is newer than every delta before it.
        assert manager.latest_checkpoint == f"{second}.delta-1"
        assert _count(second) in (1, 2, 3) and _count(f"{second}.delta-1") == 4
        assert _seq(f"{second}.delta-1") > _seq(delta)
        await _step(count, table, opt, 5)
        assert await manager.save_delta() == f"{second}.delta-2"

        # A feed reader is never shown a delta whose base is not visible yet (for a moment,
        # a base's first delta is there and its index is not).
        async with aiohttp.ClientSession() as session:
            newest = await _feed_version(session, cluster.ps[0].address)
            assert newest == _seq(f"{second}.delta-2")
            os.rename(second + ".index.json", second + ".hidden")
            assert await _feed_version(session, cluster.ps[0].address) == _seq(delta)
            os.rename(second + ".hidden", second + ".index.json")
            assert await _feed_version(session, cluster.ps[0].address) == newest
        await manager.close()

    # The whole job restarts from the newest save: 5 steps, nothing lost.
    async with _cluster(root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        count, table, _, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
        assert await manager.restore_or_initialize() == f"{second}.delta-2"
        assert (await count.read_value())[0] == 5
        ids, rows = await table.export()
        got = dict(zip(ids.tolist(), rows[:, 0].tolist()))
        assert got == {k: float(k) for k in range(1, 6)}


async def test_close_lets_a_delta_under_way_finish(tmp_path):
    root = str(tmp_path)
    async with _cluster(root, num_ps=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        count, table, opt, ckpt = _model(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root, delta_interval_s=0.05)
        await _step(count, table, opt, 1)
        base = await manager.save()
        gate = threading.Event()
        held = _save_thread("delta").submit(gate.wait, 60)  # the next delta's write waits
        try:
            await _step(count, table, opt, 2)
            await wait_for(ckpt._delta_lock.locked, timeout=30, what="the deltas' loop to write one")
            closing = asyncio.create_task(manager.close())
            await wait_for(lambda: manager._closed, what="close() to begin")
            assert not closing.done()  # it waits for the delta under way
        finally:
            gate.set()
        held.result(timeout=30)
        await asyncio.wait_for(closing, 30)
        # The delta under way was finished, not cut off: no file of it is left half-made,
        # and the next save of the directory finds nothing in its way.
        assert manager.latest_checkpoint == f"{base}.delta-1" and _count(f"{base}.delta-1") == 2
        leftovers = [f for f in os.listdir(root) if ".delta-2" in f]
        assert leftovers == []
        await _step(count, table, opt, 3)
        assert await manager.save_delta() == f"{base}.delta-2"
