"""Checkpoints on a disk that fills: a real file system of 2 MiB (a tmpfs each test mounts
with ``mount``, root, and unmounts). A save that does not fit is ResourceExhaustedError naming the file and
the full disk (not an internal error), leaves none of its files behind, and saves once
there is room again; a delta that does not fit says the same, and the deltas go on."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pstrain
from pstrain._checkpoint import checkpoint as checkpoint_module
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _cluster(disk: Path) -> InProcessCluster:
    """Two ps that write their checkpoint files under ``disk``."""
    return InProcessCluster(num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(disk)})


async def _table(cluster: InProcessCluster, rows: int) -> tuple[pstrain.DynamicEmbedding, Any]:
    """A table of ``rows`` rows over the cluster's ps, and its Adagrad."""
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="emb")
        opt = pstrain.optimizers.Adagrad(0.1)
    await table.lookup(np.arange(rows))
    return table, opt


def _room(disk: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)


async def test_a_save_that_does_not_fit_is_refused_whole_and_saves_once_there_is_room(small_disk):
    async with _cluster(small_disk) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            small = pstrain.Variable(np.arange(1000, dtype=np.float32), name="small")
            big = pstrain.Variable(np.ones(1 << 20, np.float32), name="big")  # 4 MiB: no room
            table = pstrain.DynamicEmbedding(16, name="emb")
        await table.lookup(np.arange(5000))
        manager = pstrain.CheckpointManager(
            pstrain.Checkpoint(small=small, big=big, emb=table), str(small_disk / "run"), max_to_keep=2
        )
        with pytest.raises(pstrain.errors.ResourceExhaustedError, match="No space left on device") as exc:
            await manager.save()
        assert "ckpt-1.ps" in str(exc.value) and "internal error" not in str(exc.value)
        assert os.listdir(small_disk / "run") == []  # what the other ps wrote is gone too
        assert manager.latest_checkpoint is None
        _room(small_disk, "16M")
        path = await manager.save()
        await small.assign(np.zeros(1000, np.float32))
        await pstrain.Checkpoint(small=small, big=big, emb=table).restore(path)
        np.testing.assert_array_equal(await small.read_value(), np.arange(1000, dtype=np.float32))


async def test_a_delta_that_does_not_fit_says_the_disk_is_full_and_the_deltas_go_on(small_disk, caplog):
    async with _cluster(small_disk) as cluster:
        table, opt = await _table(cluster, 2000)
        ckpt = pstrain.Checkpoint(emb=table, opt=opt)
        manager = pstrain.CheckpointManager(ckpt, str(small_disk / "run"), delta_interval_s=0.2)
        await manager.save()
        filler = _fill(small_disk)

        async def step(k: int) -> None:  # the same rows each time: a delta's size stays bounded
            ids = np.arange(2000)
            rows = await table.lookup(ids)
            grad = np.full_like(rows, 1 + k % 3)
            await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])

        with caplog.at_level(logging.WARNING):
            k = 0

            def said() -> bool:
                return any("No space left on device" in r.getMessage() for r in caplog.records)

            while not said():  # (steps until a delta tried and failed)
                await step(k)
                k += 1
                assert k < 2000, "no delta failed"
            assert not any("internal error" in r.getMessage() for r in caplog.records)
        assert ".delta-" not in (manager.latest_checkpoint or "")
        filler.unlink()
        await wait_for(lambda: ".delta-" in (manager.latest_checkpoint or ""), timeout=30, what="a delta")
        ids, rows = await table.export()
        await manager.close()
        latest = manager.latest_checkpoint
        await table.lookup(np.arange(10**6, 10**6 + 10))  # rows the checkpoint does not have
        await ckpt.restore(latest)
        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_rows, rows)


async def test_a_compaction_that_does_not_fit_is_tried_again_only_after_more_deltas(small_disk):
    # Each try of a base that does not fit writes until the disk is full, then removes it:
    # at every tick it would keep the disk full (and the deltas beside it short of room).
    run = small_disk / "run"
    seen: list[int] = []  # the deltas of the base on disk when each try failed

    class Failures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "compacting the deltas into a full checkpoint failed" in record.getMessage():
                seen.append(len(list(run.glob("ckpt-1.delta-*.index.json"))))

    handler = Failures()
    logging.getLogger("pstrain.checkpoint").addHandler(handler)
    try:
        async with _cluster(small_disk) as cluster:
            table, opt = await _table(cluster, 10_000)  # 1.3 MB with its slots: one base fits, not two
            ckpt = pstrain.Checkpoint(emb=table, opt=opt)
            manager = pstrain.CheckpointManager(
                ckpt, str(run), delta_interval_s=0.3, deltas_per_base=4, max_to_keep=1
            )
            await manager.save()
            k = 0
            while len(seen) < 2:
                ids = np.arange(50)
                rows = await table.lookup(ids)
                await opt.apply_gradients([(pstrain.IndexedSlices(np.full_like(rows, k % 3), ids), table)])
                k += 1
                assert k < 20_000, f"compactions failed after {seen} deltas"
            assert seen[1] >= seen[0] + 4, seen  # tried again after deltas_per_base more
            ids, rows = await table.export()
            latest = await manager.save_delta()  # (the steps since the last tick's delta)
            await manager.close()
            assert manager.checkpoints == [str(run / "ckpt-1")]
            assert not list(run.glob("ckpt-2*"))  # what the failed tries wrote is gone
            assert latest.startswith(str(run / "ckpt-1.delta-"))
            await ckpt.restore(latest)
            got_ids, got_rows = await table.export()
            np.testing.assert_array_equal(got_ids, ids)
            np.testing.assert_array_equal(got_rows, rows)
    finally:
        logging.getLogger("pstrain.checkpoint").removeHandler(handler)


def _fill(disk: Path) -> Path:
    """``disk`` filled to its last byte by one file, returned."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError:
                return filler


async def test_a_save_whose_index_does_not_fit_leaves_nothing_and_says_so(small_disk, monkeypatch):
    # The ps wrote their parts; the disk fills before the coordinator writes the index.
    written = checkpoint_module.write_index

    def full_then_write(*args, **kwargs):
        _fill(small_disk)
        return written(*args, **kwargs)

    async with _cluster(small_disk) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            v = pstrain.Variable(np.arange(1000, dtype=np.float32), name="v")
            table = pstrain.DynamicEmbedding(16, name="emb")
        await table.lookup(np.arange(1000))
        manager = pstrain.CheckpointManager(pstrain.Checkpoint(v=v, emb=table), str(small_disk / "run"))
        monkeypatch.setattr(checkpoint_module, "write_index", full_then_write)
        with pytest.raises(
            pstrain.errors.ResourceExhaustedError, match="ckpt-1.index.json could not be written"
        ):
            await manager.save()
        assert os.listdir(small_disk / "run") == []  # the ps's parts too
        monkeypatch.undo()
        (small_disk / "filler").unlink()
        path = await manager.save()
        assert path == str(small_disk / "run" / "ckpt-1") and manager.latest_checkpoint == path
