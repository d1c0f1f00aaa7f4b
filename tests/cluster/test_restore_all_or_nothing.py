"""Restores are all or nothing across the ps, tables included: a damaged table file in a
delta fails the restore before any variable or table changed; and a table's capacity is
shared as a total, so a 2-ps save of a nearly full table restores into 1 to 4 ps."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import pstrain
from pstrain.errors import InvalidArgumentError
from pstrain.testing import InProcessCluster

pytestmark = pytest.mark.timeout(120)

DIM, CAPACITY = 4, 2000


def _model(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="emb", capacity=CAPACITY)
        dense = pstrain.Variable(np.zeros(3, np.float32), name="dense")
    return table, dense


async def test_a_nearly_full_table_saved_on_two_ps_restores_into_one_to_four(tmp_path):
    root = str(tmp_path)
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        table, dense = _model(cluster)
        await table.lookup(np.arange(1979, dtype=np.int64))
        saved_ids, saved_rows = await table.export()
        assert saved_ids.size > 1900  # nearly full: each shard close to its half
        path = await pstrain.Checkpoint(table=table, dense=dense).save(f"{root}/ckpt")
    for num_ps in (1, 3, 4):
        async with InProcessCluster(
            num_ps=num_ps, num_workers=1, ps_options={"checkpoint_root": root}
        ) as cluster:
            table, dense = _model(cluster)
            await pstrain.Checkpoint(table=table, dense=dense).restore(path)
            ids, rows = await table.export()
            np.testing.assert_array_equal(ids, saved_ids)
            np.testing.assert_array_equal(rows, saved_rows)
            capacities = [ps.table_handlers.tables[table.key].config.capacity for ps in cluster.ps]
            assert sum(capacities) == CAPACITY, capacities  # shared as a total
            held = [len(ps.table_handlers.tables[table.key]) for ps in cluster.ps]
            assert all(h <= c for h, c in zip(held, capacities))


async def test_a_table_bigger_than_its_capacity_is_refused_and_nothing_changes(tmp_path):
    root = str(tmp_path)
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            big = pstrain.DynamicEmbedding(DIM, name="emb", capacity=CAPACITY)
        await big.lookup(np.arange(1500, dtype=np.int64))
        path = await pstrain.Checkpoint(table=big).save(f"{root}/ckpt")
    async with InProcessCluster(num_ps=3, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            small = pstrain.DynamicEmbedding(DIM, name="emb", capacity=1000)
        await small.lookup(np.arange(5, dtype=np.int64))
        before = await small.export()
        with pytest.raises(InvalidArgumentError, match="more than the table's capacity of 1000"):
            await pstrain.Checkpoint(table=small).restore(path)
        after = await small.export()
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
        assert not any(ps.table_handlers.restores.staged for ps in cluster.ps)  # aborted everywhere


@pytest.mark.parametrize("damage", ["row width", "another table's prefix"])
async def test_a_damaged_table_file_in_a_delta_fails_the_restore_before_anything_changes(tmp_path, damage):
    root = str(tmp_path)
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        table, dense = _model(cluster)
        ckpt = pstrain.Checkpoint(table=table, dense=dense)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
        await table.lookup(np.arange(100, dtype=np.int64))
        await manager.save()
        await dense.assign(np.ones(3, np.float32))
        await table.lookup(np.arange(100, 150, dtype=np.int64))
        delta = await manager.save_delta()
        with open(f"{delta}.index.json") as f:
            index = json.load(f)
        entry = next(iter(index["tables"].values()))
        prefix = entry["prefix"]
        for name in entry["files"]:
            file = f"{root}/{name}"
            tensors = load_file(file)
            if damage == "row width":
                rows = tensors[f"{prefix}:rows"]
                tensors[f"{prefix}:rows"] = np.concatenate([rows, rows[:, :1]], axis=1)
            else:  # the keys of a table that is not this one
                tensors = {k.replace(f"{prefix}:", "other:", 1): v for k, v in tensors.items()}
            save_file(tensors, file)
        # the job goes on; then a restore of the damaged delta is asked for
        await dense.assign(np.full(3, 7.0, np.float32))
        await table.lookup(np.arange(200, 210, dtype=np.int64))
        before = await table.export()
        with pytest.raises(InvalidArgumentError):
            await ckpt.restore(delta)
        assert (await dense.read_value()).tolist() == [7.0, 7.0, 7.0]  # not replaced
        after = await table.export()
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
        staged = [ps.table_handlers.restores.staged or ps.checkpoints.staged_bytes() for ps in cluster.ps]
        assert not any(staged), staged
        await manager.close()
