"""Checkpoint chains made by random sequences of training (a table that evicts past its
capacity, and a variable), full saves, deltas, compactions and pruned saves, restored at
random points into other jobs (one to three ps, in RAM or tiered): each restore holds
exactly what the job held when its latest save was taken."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import pstrain
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(180)

DIM = 16


def _cluster(root: str, num_ps: int, tier: str | None) -> InProcessCluster:
    options = {"checkpoint_root": root}
    if tier is not None:  # a few thousand rows in RAM a ps: most of the table on disk
        options |= {"memory_budget": 1 << 20, "table_dir": tier, "table_segment_rows": 64}
    return InProcessCluster(num_ps=num_ps, num_workers=1, token=TOKEN, ps_options=options)


async def _model(strategy: pstrain.ParameterServerStrategy, capacity: int | None) -> tuple[object, ...]:
    with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="emb", capacity=capacity)
        dense = pstrain.Variable(np.zeros(64, np.float32), name="dense")
        opt = pstrain.optimizers.Adagrad(0.1)
    return table, dense, opt, pstrain.Checkpoint(model={"emb": table, "dense": dense}, optimizer=opt)


@pytest.mark.parametrize("seed", range(int(os.environ.get("PSTRAIN_CHECKPOINT_SEEDS", 6))))
async def test_a_restore_at_any_point_of_a_random_chain_is_the_job_as_saved(tmp_path, seed):
    rng = random.Random(seed)
    root = str(tmp_path)
    done: list[str] = []
    capacity = [None, 2500][seed % 2]
    async with _cluster(root, 2, str(tmp_path / "tier") if seed % 3 == 2 else None) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        table, dense, opt, ckpt = await _model(strategy, capacity)
        manager = pstrain.checkpoint.CheckpointManager(
            ckpt, os.path.join(root, "ckpt"), max_to_keep=2, deltas_per_base=rng.choice([2, 4])
        )
        saved = None
        for k in range(30):
            op = rng.choices(["step", "save", "delta", "compact", "restore"], [5, 1, 3, 1, 2])[0]
            done.append(op)
            if op == "step":
                ids = np.unique(np.array([rng.randrange(0, 20_000) for _ in range(rng.randrange(1, 800))]))
                rows = await table.lookup(ids)
                grad = np.tanh(rows + np.sin(ids + k)[:, None]).astype(np.float32)
                await opt.apply_gradients(
                    [(pstrain.IndexedSlices(grad, ids), table), (np.full(64, k - 7.5, np.float32), dense)]
                )
            elif op in ("save", "delta", "compact"):
                if op == "save" or saved is None:
                    path = await manager.save()
                elif op == "delta":
                    path = await manager.save_delta()
                else:
                    path = await manager.compact()
                saved = (path, await table.export(), await dense.read_value())
            elif saved is not None:  # into another job: 1 to 3 ps, in RAM or tiered
                path, (want_ids, want_rows), want_dense = saved
                num_ps = rng.choice([1, 2, 3])
                tier = str(tmp_path / f"tier-{k}") if rng.random() < 0.5 else None
                async with _cluster(root, num_ps, tier) as other:
                    table2, dense2, _, ckpt2 = await _model(
                        pstrain.ParameterServerStrategy(other.resolver), capacity
                    )
                    (await ckpt2.restore(path)).assert_consumed()
                    ids, rows = await table2.export()
                    what = f"{path} onto {num_ps} ps ({'tiered' if tier else 'in RAM'}) after {done}"
                    np.testing.assert_array_equal(ids, want_ids, err_msg=what)
                    np.testing.assert_array_equal(rows, want_rows, err_msg=what)
                    np.testing.assert_array_equal(await dense2.read_value(), want_dense, err_msg=what)
        await manager.close()


async def _steps(table, dense, opt, rng: random.Random, n: int, k0: int, most: int = 800) -> None:
    for k in range(k0, k0 + n):
        ids = np.unique(np.array([rng.randrange(0, 20_000) for _ in range(rng.randrange(1, most))]))
        rows = await table.lookup(ids)
        grad = np.tanh(rows + np.sin(ids + k)[:, None]).astype(np.float32)
        await opt.apply_gradients(
            [(pstrain.IndexedSlices(grad, ids), table), (np.full(64, k - 7.5, np.float32), dense)]
        )


@pytest.mark.parametrize("seed", range(int(os.environ.get("PSTRAIN_CHECKPOINT_SEEDS", 6)) // 3))
async def test_a_tiered_job_restored_from_a_chain_trains_saves_and_restores_as_one_in_ram(tmp_path, seed):
    """A chain restored onto tiered ps (its base's files linked into their tiers, not
    written again) and onto ps in RAM; both train on alike, save (a full save of the
    tiered job links what it still reads from the chain), save deltas and compact; each
    of their chains restored again onto other ps is the job as it was."""
    rng = random.Random(seed)
    root = str(tmp_path)
    capacity = None  # (past a capacity, a tiered shard evicts other rows than one in RAM)
    async with _cluster(root, 2, None) as cluster:
        table, dense, opt, ckpt = await _model(pstrain.ParameterServerStrategy(cluster.resolver), capacity)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, os.path.join(root, "first"), deltas_per_base=4)
        await _steps(table, dense, opt, rng, 6, 0, most=4000)  # (some 9,000 rows: past the budgets)
        await manager.save()
        for k in range(3):
            await _steps(table, dense, opt, rng, 2, 6 + 2 * k)
            await manager.save_delta()
        chain = manager.latest_checkpoint
        await manager.close()
    follow = rng.getstate()
    got = {}
    for kind in ("ram", "tiered"):
        rng.setstate(follow)  # the same steps in both
        tier = str(tmp_path / f"tier-{kind}") if kind == "tiered" else None
        async with _cluster(root, 2, tier) as job:
            table, dense, opt, ckpt = await _model(pstrain.ParameterServerStrategy(job.resolver), capacity)
            (await ckpt.restore(chain)).assert_consumed()
            if tier is not None:
                assert (await table.statistics())["cold_rows"] > 0  # (most of it on disk)
            manager = pstrain.checkpoint.CheckpointManager(ckpt, os.path.join(root, kind), deltas_per_base=2)
            states = []
            for k in range(4):
                await _steps(table, dense, opt, rng, 2, 20 + 2 * k)
                path = await [manager.save, manager.save_delta, manager.compact, manager.save_delta][k]()
                states.append((path, await table.export(), await dense.read_value()))
            await manager.close()
        got[kind] = states
    for (path_r, (ids_r, rows_r), dense_r), (path_t, (ids_t, rows_t), dense_t) in zip(
        got["ram"], got["tiered"]
    ):
        np.testing.assert_array_equal(ids_t, ids_r)
        np.testing.assert_array_equal(rows_t, rows_r)
        np.testing.assert_array_equal(dense_t, dense_r)
        for path in (path_r, path_t):  # each chain, onto 3 ps in RAM
            async with _cluster(root, 3, None) as other:
                table, dense, _, ckpt = await _model(
                    pstrain.ParameterServerStrategy(other.resolver), capacity
                )
                (await ckpt.restore(path)).assert_consumed()
                ids, rows = await table.export()
                np.testing.assert_array_equal(ids, ids_r, err_msg=path)
                np.testing.assert_array_equal(rows, rows_r, err_msg=path)
                np.testing.assert_array_equal(await dense.read_value(), dense_r, err_msg=path)
