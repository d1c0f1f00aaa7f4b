"""A restore does not hold a variable's initial values beside the values it reads: a
variable that still holds only its initializer's values gives their memory back while the
restore stages, and gets them again, bit for bit, if the restore fails."""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest

import pstrain
from pstrain._variables import staged_restore
from pstrain.partitioners import FixedShardsPartitioner
from pstrain.server.ps.checkpoints import saves as checkpoint
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(60)

SHAPE = (4096, 64)


def _strategy(cluster):
    return pstrain.ParameterServerStrategy(cluster.resolver, variable_partitioner=FixedShardsPartitioner(2))


def _records(cluster, table):
    return [ps.store.find(part.key) for ps, part in zip(cluster.ps, table.variables)]


async def _saved(tmp_path) -> tuple[str, np.ndarray]:
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        with _strategy(cluster).scope():
            table = pstrain.Variable(pstrain.initializers.RandomUniform(-1, 1, seed=5), shape=SHAPE, name="t")
        await table.assign_add(np.ones(SHAPE, np.float32))
        path = await pstrain.Checkpoint(table=table).save(str(tmp_path / "c"))
        return path, await table.numpy()


@contextlib.asynccontextmanager
async def _fresh(tmp_path):
    """A new cluster, with the variable to restore into at its initial values."""
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        with _strategy(cluster).scope():
            table = pstrain.Variable(pstrain.initializers.RandomUniform(-1, 1, seed=9), shape=SHAPE, name="t")
        initial = await table.numpy()  # created on the ps (at first use) and read
        yield cluster, table, initial


async def test_a_restore_replaces_initial_values_without_holding_them_beside_its_own(tmp_path):
    path, saved = await _saved(tmp_path)
    async with _fresh(tmp_path) as (cluster, table, _):
        records = _records(cluster, table)
        assert all(r.initial is not None for r in records)  # a read changes nothing
        status = await pstrain.Checkpoint(table=table).restore(path)
        status.assert_consumed()
        np.testing.assert_array_equal(await table.numpy(), saved)
        assert all(r.initial is None for r in records)  # the restored values are its own
        assert sum(ps.store.nbytes for ps in cluster.ps) == saved.nbytes


async def test_initial_values_given_back_during_a_failed_restore_come_back_bit_for_bit(tmp_path):
    path, _ = await _saved(tmp_path)
    async with _fresh(tmp_path) as (cluster, table, initial):
        # ps 1 may not hold what it would read (--max-store-bytes): the restore fails there,
        # so every ps drops what it staged
        cluster.ps[1].checkpoints.max_store_bytes = 1
        records = _records(cluster, table)
        held = records[0].array
        with pytest.raises(pstrain.errors.ResourceExhaustedError, match="--max-store-bytes"):
            await pstrain.Checkpoint(table=table).restore(path)
        # ps 0 gave its initial values back while it staged, and made them again (off its
        # serving loop) when the restore was aborted: a new array, the same values
        assert records[0].loaded and records[0].array is not held
        del held
        np.testing.assert_array_equal(await table.numpy(), initial)
        await table.assign_add(np.ones(SHAPE, np.float32))  # and trained from there
        np.testing.assert_array_equal(await table.numpy(), initial + 1)
        assert all(r.initial is None for r in records)


async def test_a_variable_that_changed_is_not_given_back(tmp_path):
    path, saved = await _saved(tmp_path)
    async with _fresh(tmp_path) as (cluster, table, _):
        await table.assign_add(np.ones(SHAPE, np.float32))
        records = _records(cluster, table)
        assert all(r.initial is None and r.release_initial() is False for r in records)
        await pstrain.Checkpoint(table=table).restore(path)
        np.testing.assert_array_equal(await table.numpy(), saved)


async def test_a_restore_refused_for_too_many_staged_releases_nothing(tmp_path, monkeypatch):

    path, _ = await _saved(tmp_path)
    async with _fresh(tmp_path) as (cluster, table, initial):
        monkeypatch.setattr(checkpoint, "MAX_STAGED", 0)  # every staged restore is one too many
        records = _records(cluster, table)
        held = [r.array for r in records]
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="staged"):
            await pstrain.Checkpoint(table=table).restore(path)
        assert all(r.loaded and r.array is a for r, a in zip(records, held))  # never released
        np.testing.assert_array_equal(await table.numpy(), initial)


async def test_a_restore_staged_and_never_committed_goes_when_its_time_is_up(tmp_path, monkeypatch):
    """A coordinator that stops between staging a restore and committing it (here: its
    commit is never sent) leaves the values read staged on every ps: they go after
    STAGE_TTL_S with no other restore to sweep them, and the variable reads its initial
    values again."""

    def never(**_):
        raise RuntimeError("the coordinator stopped before its commit")

    path, _ = await _saved(tmp_path)
    async with _fresh(tmp_path) as (cluster, table, initial):
        monkeypatch.setattr(checkpoint, "STAGE_TTL_S", 2.0)
        monkeypatch.setattr(staged_restore, "CommitRestore", never)
        with pytest.raises(RuntimeError, match="before its commit"):
            await pstrain.Checkpoint(table=table).restore(path)
        assert all(ps.checkpoints.staged_bytes() > 0 for ps in cluster.ps)
        await wait_for(
            lambda: all(ps.checkpoints.staged_bytes() == 0 for ps in cluster.ps),
            timeout=20,
            what="the staged restore dropped",
        )
        np.testing.assert_array_equal(await table.numpy(), initial)


async def test_the_values_of_an_aborted_restore_go_at_once_not_when_its_time_is_up(tmp_path, monkeypatch):
    """Aborting a staged restore gives its values' memory back then: the timer that would
    have dropped it holds its name only, not the values it read."""

    def never(**_):
        raise RuntimeError("the coordinator stopped before its commit")

    path, _ = await _saved(tmp_path)
    async with _fresh(tmp_path) as (cluster, table, _):
        monkeypatch.setattr(staged_restore, "CommitRestore", never)
        with pytest.raises(RuntimeError, match="before its commit"):
            await pstrain.Checkpoint(table=table).restore(path)
        read = [
            weakref.ref(a)
            for ps in cluster.ps
            for built, *_ in ps.checkpoints._staged.values()
            for _, a, *_ in built
        ]
        stages = [(ps, stage) for ps in cluster.ps for stage in list(ps.checkpoints._staged)]
        assert read and stages
        for ps, stage in stages:
            assert await ps.checkpoints.abort(stage)  # there was a stage to drop
        del stages
        gc.collect()
        assert not [r for r in read if r() is not None]
