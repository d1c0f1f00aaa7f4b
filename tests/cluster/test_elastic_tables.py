"""Dynamic tables on elastic parameter servers: slices of a table's hash space move to a ps
that joins and off a ps that leaves, while training runs, with their rows, optimizer
slots, eviction state and admission sightings; nothing is lost or applied twice, and a
request sent by an old map is refused whole and routed again."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import threading
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import pytest_asyncio

import pstrain
from pstrain._base.tags import set_dispatch
from pstrain._coordinator.elastic import moves as ps_moves
from pstrain._formats.messages.placement_map import EndMove, InstallVariables, SliceSet, TableCopy, TablePatch
from pstrain._formats.numerics.idhash import shard_of
from pstrain.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PlacementChangedError,
    ResourceExhaustedError,
)
from pstrain.rpc import Channel
from pstrain.server import ParameterServer
from pstrain.server.ps.moves import handlers as moves
from pstrain.server.ps.store import ChangeClock
from pstrain.server.ps.tables.cold_rows import ColdRows
from pstrain.server.ps.tables.dynamic_table import DynamicTable, TableConfig
from pstrain.server.ps.tables.tiered_slices import CopyStream, TieredSlices
from pstrain.testing import InProcessCluster, untyped_call
from tests.helpers import TOKEN, table_feed_example, wait_for

pytestmark = pytest.mark.timeout(120)

DIM, STEPS, BATCH = 4, 60, 96
#: A ps's budget in the tiered runs: a few hundred of its rows in RAM, the rest on disk
#: (rows of TIER_DIM floats, so that they, not the fixed sizes of empty indexes, fill it).
TIER_BUDGET, TIER_DIM = 352 << 10, 64
#: ids spread over the whole 64-bit space (a table's ids are raw keys)
POOL = np.random.default_rng(7).integers(-(2**62), 2**62, 3000, dtype=np.int64)


def _batch(step: int, dim: int = DIM) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s ids and whole-number gradients (any order of applying them sums to
    the same floats)."""
    rng = np.random.default_rng(step)
    ids = rng.choice(POOL, BATCH, replace=False)
    return ids, rng.integers(-3, 4, (BATCH, dim)).astype(np.float32)


def _expected(steps: int, dim: int = DIM) -> dict[int, np.ndarray]:
    rows: dict[int, np.ndarray] = {}
    for step in range(steps):
        ids, grads = _batch(step, dim)
        for i, g in zip(ids.tolist(), grads):
            rows[i] = rows.get(i, np.zeros(dim, np.float32)) - g
    return rows


@contextlib.asynccontextmanager
async def _job(
    num_ps: int = 2,
    *,
    workers: int = 1,
    extra: bool = True,
    root: str | None = None,
    token: str | None = None,
    tier: str | None = None,
    budget: int = TIER_BUDGET,
    segment_rows: int = 128,
) -> AsyncIterator[tuple[Any, ParameterServer | None, Any, Any]]:
    """In-process ps and workers (checkpoints under ``root``), a further ps not in the job
    yet (``extra``), a strategy without partitioner and its coordinator (closed after);
    ``tier``: every ps keeps its tables' rows past ``budget`` on disk under it, in segments
    of ``segment_rows``."""
    options: dict[str, Any] = {"checkpoint_root": root} if root else {}
    if tier:
        options.update(memory_budget=budget, table_dir=tier, table_segment_rows=segment_rows)
    async with InProcessCluster(
        num_ps=num_ps, num_workers=workers, token=token, ps_options=options or None
    ) as cluster:
        spare = ParameterServer(num_ps, token=cluster.token, **options) if extra else None
        if spare is not None:
            await spare.start()
        try:
            strategy = pstrain.ParameterServerStrategy(
                pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
            )
            coordinator = pstrain.ClusterCoordinator(strategy)
            yield cluster, spare, strategy, coordinator
            await coordinator.close()
        finally:
            if spare is not None:
                await spare.stop()


def _same_rows(ids: np.ndarray, rows: np.ndarray, expected: dict[int, np.ndarray]) -> None:
    assert sorted(ids.tolist()) == sorted(expected)
    wrong = [i for i, row in zip(ids.tolist(), rows) if not np.array_equal(row, expected[i])]
    assert not wrong, f"{len(wrong)} rows lost or doubled an update"


def _ids_on(ps: ParameterServer, key: str) -> np.ndarray:
    table = ps.tables.get(key)
    if table is None:
        return np.empty(0, np.int64)
    return table.export()["ids"]


def _runner(
    coordinator: pstrain.ClusterCoordinator, table: pstrain.DynamicEmbedding, opt: Any, dim: int = DIM
) -> Callable[[int, int], Awaitable[None]]:
    """``await run(start, stop)``: steps ``start`` to ``stop - 1`` (a lookup, then the
    update), each an exactly-once closure, then ``join``."""

    async def step_fn(step: int) -> None:
        ids, grads = _batch(step, dim)
        await table.lookup(ids)
        await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])

    async def run(start: int, stop: int) -> None:
        for step in range(start, stop):
            coordinator.schedule(step_fn, args=(step,), exactly_once=True)
        await coordinator.join()

    return run


async def _sgd_table_saved_by_manager(
    strategy: pstrain.ParameterServerStrategy, root: str, dim: int = DIM
) -> tuple[Any, Any, Any]:
    """A table ``t`` of zeros with SGD(1.0), and a CheckpointManager of both under ``root``."""
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(dim, name="t", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
    manager = pstrain.checkpoint.CheckpointManager(pstrain.checkpoint.Checkpoint(table=table, opt=opt), root)
    return table, opt, manager


def _check_map(
    coordinator: pstrain.ClusterCoordinator, servers: list[ParameterServer], table: pstrain.DynamicEmbedding
) -> None:
    """Every ps holds exactly the ids of the slices the map gives it."""
    sliced = coordinator.ps.table_slices(table)
    for k, ps in enumerate(servers):
        ids = _ids_on(ps, table.key)
        owners = np.asarray(sliced.owners)[shard_of(ids, sliced.slices)] if ids.size else ids
        assert np.all(owners == k), f"ps {k} holds ids of slices it does not own"


async def test_table_slices_move_to_a_joining_ps_and_off_a_leaving_one_while_training_runs():
    async with _job(workers=2) as (cluster, extra, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="users", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)

        async def step_fn(step: int) -> None:
            ids, grads = _batch(step)
            await table.lookup(ids)  # admits them
            await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])

        for step in range(STEPS // 3):
            coordinator.schedule(step_fn, args=(step,), exactly_once=True)
        await wait_for(lambda: coordinator.closures_done >= 5, timeout=30, what="training to start")
        assert await coordinator.add_ps(extra.address) == 2  # while closures run
        for step in range(STEPS // 3, 2 * STEPS // 3):
            coordinator.schedule(step_fn, args=(step,), exactly_once=True)
        await coordinator.join()
        servers = [*cluster.ps, extra]
        sliced = coordinator.ps.table_slices(table)
        held = [len(sliced.held_by(k)) for k in range(3)]
        assert sum(held) == sliced.slices and min(held) >= sliced.slices // 3
        assert _ids_on(extra, table.key).size > 0
        _check_map(coordinator, servers, table)
        shares = coordinator.statistics()["placement"]["ps"][2]["table_shares"]
        assert shares["users"] == pytest.approx(held[2] / sliced.slices, abs=1e-3)
        endpoint = await coordinator.serve_metrics()
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"http://{endpoint}/metrics", headers={"Authorization": f"Bearer {cluster.token}"}
            ) as r,
        ):
            text = await r.text()
        line = next(
            ln
            for ln in text.splitlines()
            if ln.startswith("pstrain_placement_table_share") and 'ps="2"' in ln
        )
        assert float(line.split()[-1]) == pytest.approx(shares["users"])

        await coordinator.remove_ps(0)  # ps 0 leaves: its slices go to ps 1 and 2
        for step in range(2 * STEPS // 3, STEPS):
            coordinator.schedule(step_fn, args=(step,), exactly_once=True)
        await coordinator.join()
        assert _ids_on(cluster.ps[0], table.key).size == 0
        assert set(coordinator.ps.table_slices(table).owners) == {1, 2}
        _check_map(coordinator, servers, table)
        # the workers route by the newest map (learnt from a refusal, or with a batch of
        # closures sent after it changed)
        newest = coordinator.ps.placement.version
        assert [w.channels.session.routes.version for w in cluster.workers] == [newest, newest]

        expected = _expected(STEPS)
        _same_rows(*await table.export(), expected)
        assert (await table.statistics())["rows"] == len(expected)


async def test_a_tiered_tables_slices_move_with_their_rows_on_disk_while_training_runs(tmp_path):
    async with _job(workers=2, tier=str(tmp_path / "tier")) as (cluster, extra, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(TIER_DIM, name="users", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        run = _runner(coordinator, table, opt, TIER_DIM)
        await run(0, STEPS // 3)
        assert (await table.statistics())["cold_rows"] > 0
        assert await coordinator.add_ps(extra.address) == 2
        await run(STEPS // 3, 2 * STEPS // 3)
        servers = [*cluster.ps, extra]
        joined = extra.tables[table.key].statistics()
        # the ps that joined tiers its share too, within its own budget
        assert joined["rows"] > 0 and joined["budget"] == TIER_BUDGET and joined["cold_rows"] > 0, joined
        _check_map(coordinator, servers, table)
        await coordinator.remove_ps(0)  # its rows, on disk and in RAM, go to ps 1 and 2
        await run(2 * STEPS // 3, STEPS)
        assert _ids_on(cluster.ps[0], table.key).size == 0
        _check_map(coordinator, servers, table)
        expected = _expected(STEPS, TIER_DIM)
        _same_rows(*await table.export(), expected)
        stats = await table.statistics()
        assert stats["rows"] == len(expected) and stats["cold_rows"] > 0 and stats["refused"] == 0, stats


async def test_a_tiered_table_restored_from_linked_files_moves_its_slices_as_any(tmp_path):
    """Rows a restore left in the checkpoint's files linked into the tier (read by column)
    move to a ps that joins and from one that leaves with the rest, while training runs."""
    async with _job(workers=2, tier=str(tmp_path / "tier"), root=str(tmp_path)) as job:
        cluster, extra, strategy, coordinator = job
        assert extra is not None
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(TIER_DIM, name="users", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        run = _runner(coordinator, table, opt, TIER_DIM)
        await run(0, STEPS // 3)
        saved = await pstrain.Checkpoint(table=table).save(str(tmp_path / "ckpt"))
        await pstrain.Checkpoint(table=table).restore(saved)
        linked = [
            name
            for ps in cluster.ps
            for name in os.listdir(ps.tables[table.key].cold.directory)
            if name.endswith(".ref")
        ]
        assert len(linked) == 2, linked
        assert await coordinator.add_ps(extra.address) == 2
        await run(STEPS // 3, 2 * STEPS // 3)
        await coordinator.remove_ps(0)
        await run(2 * STEPS // 3, STEPS)
        assert _ids_on(cluster.ps[0], table.key).size == 0
        _same_rows(*await table.export(), _expected(STEPS, TIER_DIM))


def _adagrad_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s distinct ids (new ones from the whole 64-bit space, and a Zipf head
    that comes back) and their gradients."""
    rng = np.random.default_rng(1000 + step)
    new = rng.integers(-(2**62), 2**62, 40, dtype=np.int64)
    head = (rng.zipf(1.3, 80) % 2000).astype(np.int64)
    ids = np.unique(np.concatenate([new, head]))
    return ids, rng.integers(-3, 4, (ids.size, TIER_DIM)).astype(np.float32) / 4


def _accumulators(servers: list[ParameterServer], key: str, optimizer: Any) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for ps in servers:
        shard = ps.tables.get(key)
        if shard is not None and len(shard):
            exported = shard.export()
            out.update(zip(exported["ids"].tolist(), exported[f"slot:{optimizer.name}/accumulator"]))
    return out


@pytest.mark.parametrize("max_age", [None, 12])
async def test_a_tiered_adagrad_table_through_a_join_a_leave_and_deltas_restores_as_it_trained(
    tmp_path, max_age
):
    """A tiered table trained with Adagrad (rows evicted by age, or none), saved, then a ps
    joins and one leaves between deltas: the live table is the one a model kept here
    trained (rows and accumulators; without eviction), and base + deltas restored onto
    three other tiered ps is the live table, every row and accumulator."""
    lr, acc0 = 0.1, 0.1
    async with _job(workers=1, tier=str(tmp_path / "tier"), root=str(tmp_path)) as job:
        cluster, extra, strategy, coordinator = job
        assert extra is not None
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(TIER_DIM, name="users", max_age=max_age)
            opt = pstrain.optimizers.Adagrad(lr, initial_accumulator_value=acc0)
        manager = pstrain.checkpoint.CheckpointManager(
            pstrain.checkpoint.Checkpoint(table=table, opt=opt), str(tmp_path)
        )
        model: dict[int, np.ndarray] = {}
        accumulators: dict[int, np.ndarray] = {}

        async def step_fn(step: int) -> np.ndarray:
            ids, grads = _adagrad_batch(step)
            rows = await table.lookup(ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])
            return rows

        async def run(start: int, stop: int) -> None:
            for step in range(start, stop):  # one at a time: the model follows each lookup
                rows = await coordinator.schedule(step_fn, args=(step,), exactly_once=True)
                ids, grads = _adagrad_batch(step)
                for i, row, g in zip(ids.tolist(), np.asarray(rows, np.float64), grads.astype(np.float64)):
                    if max_age is None and i in model:
                        np.testing.assert_allclose(row, model[i], rtol=0, atol=1e-5)
                    acc = accumulators.get(i, np.full(TIER_DIM, acc0)) + g * g
                    accumulators[i], model[i] = acc, row - lr * g / np.sqrt(acc + 1e-7)

        await run(0, 12)
        await manager.save()
        await run(12, 18)
        await manager.save_delta()
        assert await coordinator.add_ps(extra.address) == 2
        await run(18, 26)
        await manager.save_delta()
        await coordinator.remove_ps(0)  # its rows in RAM and on disk go to ps 1 and 2
        await run(26, 34)
        path = await manager.save_delta()
        stats = await table.statistics()
        assert stats["cold_rows"] > 0 and stats["refused"] == 0, stats
        assert (stats["evicted"] > 0) == (max_age is not None), stats
        live_ids, live_rows = await table.export()
        live_acc = _accumulators([*cluster.ps, extra], table.key, opt)
        if max_age is None:
            assert sorted(live_ids.tolist()) == sorted(model)
            for i, row in zip(live_ids.tolist(), live_rows):
                np.testing.assert_allclose(row, model[i], rtol=0, atol=1e-5)
                np.testing.assert_allclose(live_acc[i], accumulators[i], rtol=1e-6)
    async with _job(3, extra=False, tier=str(tmp_path / "tier2"), root=str(tmp_path)) as job:
        cluster, _, strategy, coordinator = job
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(TIER_DIM, name="users", max_age=max_age)
            opt = pstrain.optimizers.Adagrad(lr, initial_accumulator_value=acc0)
        (await pstrain.checkpoint.Checkpoint(table=table, opt=opt).restore(path)).assert_consumed()
        ids, rows = await table.export()
        assert sorted(ids.tolist()) == sorted(live_ids.tolist())
        live = dict(zip(live_ids.tolist(), live_rows))
        restored_acc = _accumulators(cluster.ps, table.key, opt)
        wrong = [
            i
            for i, row in zip(ids.tolist(), rows)
            if not (np.array_equal(row, live[i]) and np.array_equal(restored_acc[i], live_acc[i]))
        ]
        assert not wrong, f"{len(wrong)} of {ids.size} rows or accumulators differ from the live table"
        if max_age is None:  # (the rows age leaves fit three ps's RAM)
            assert (await table.statistics())["cold_rows"] > 0


def _collection_batch(step: int) -> tuple[Any, np.ndarray]:
    """Step ``step``'s bags for features a (table "small"), b and d (both "big") and c
    ("dyn"), 0 to 3 ids each, and a whole-number gradient of the pooled output."""
    rng = np.random.default_rng(step)
    jts = {}
    for feature, high in (("a", 50), ("b", 3000), ("c", 2**40), ("d", 3000)):
        lengths = rng.integers(0, 4, 64)
        jts[feature] = pstrain.JaggedTensor(rng.integers(0, high, lengths.sum()), lengths=lengths)
    return pstrain.KeyedJaggedTensor.from_jt_dict(jts), rng.integers(-2, 3, (64, 12)).astype(np.float32)


@pytest.mark.parametrize("tiered", [False, True])
async def test_a_collections_tables_train_exactly_while_a_ps_joins_and_one_leaves(tmp_path, tiered):
    """A collection's small, row-sharded and dynamic tables and a dense variable, read and
    updated in one request per ps by two workers (two tables with optimizers of their own,
    their steps in the same requests), while a ps joins and one leaves: every row ends as
    the steps' gradients give it, none lost or applied twice."""
    # (pooled columns in the collection's feature order: its tables', each table's features)
    steps, dims = 60, {"a": ("small", 0), "b": ("big", 3), "d": ("big", 6), "c": ("dyn", 9)}
    tier = {"tier": str(tmp_path / "tier")} if tiered else {}
    async with _job(workers=2, **tier) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        zeros = pstrain.initializers.Zeros()
        async with strategy.scope():
            collection = pstrain.EmbeddingCollection(
                [
                    pstrain.TableConfig(
                        "small", 50, 3, ["a"], initializer=zeros, optimizer=pstrain.optimizers.SGD(1.0)
                    ),
                    pstrain.TableConfig("big", 3000, 3, ["b", "d"], initializer=zeros),
                    pstrain.TableConfig(
                        "dyn", None, 3, ["c"], initializer=zeros, optimizer=pstrain.optimizers.SGD(1.0)
                    ),
                ],
                shard_rows=1000,
            )
            dense = pstrain.Variable(np.zeros(5, np.float32))
            opt = pstrain.optimizers.SGD(1.0)

        async def step_fn(step: int) -> None:
            features, d_pooled = _collection_batch(step)
            pooled = await collection.lookup(features, read=[dense])
            await collection.apply_gradients(
                [*pooled.gradients(d_pooled), (np.ones(5, np.float32), dense)], opt
            )

        for step in range(steps):
            coordinator.schedule(step_fn, args=(step,), exactly_once=True)
            if step == 15:
                assert await coordinator.add_ps(extra.address) == 2  # while closures run
            if step == 40:
                await coordinator.remove_ps(0)
        await coordinator.join()
        assert _ids_on(cluster.ps[0], collection.tables["dyn"].key).size == 0
        assert _ids_on(extra, collection.tables["dyn"].key).size > 0

        expected: dict[str, dict[int, np.ndarray]] = {"small": {}, "big": {}, "dyn": {}}
        for step in range(steps):
            features, d_pooled = _collection_batch(step)
            for feature, (table, column) in dims.items():
                bags = features[feature]
                for example, (start, end) in enumerate(zip(bags.offsets[:-1], bags.offsets[1:])):
                    for i in bags.values[start:end].tolist():
                        row = expected[table].setdefault(i, np.zeros(3, np.float32))
                        row -= d_pooled[example, column : column + 3]
        for name in ("small", "big"):
            want = np.zeros((collection.configs[name].num_embeddings, 3), np.float32)
            for i, row in expected[name].items():
                want[i] = row
            np.testing.assert_array_equal(np.asarray(await collection.tables[name].read_value()), want)
        _same_rows(*await collection.tables["dyn"].export(), expected["dyn"])
        if tiered:  # (the dynamic table has rows on disk)
            assert (await collection.tables["dyn"].statistics())["cold_rows"] > 0
        np.testing.assert_array_equal(np.asarray(await dense.read_value()), np.full(5, -steps, np.float32))
        for counted in (opt, *collection.optimizers.values()):  # each step counted once
            assert int(await counted.iterations.numpy()) == steps


@pytest.mark.parametrize("tiered", [False, True])
async def test_saves_deltas_a_join_and_a_leave_started_together_while_training_runs_lose_nothing(
    tmp_path, tiered
):
    """A delta, a join and a full save asked for at once while closures run, then a leave
    and a delta at once: each is done in some order (a delta that would miss the ps that
    joined is written as a full save instead), the table ends exact, and its last delta
    restored onto three other ps is the table."""
    dim = TIER_DIM if tiered else DIM  # (tiered: rows wide enough to fill the budget)
    tier = {"tier": str(tmp_path / "tier")} if tiered else {}
    async with _job(workers=2, root=str(tmp_path), **tier) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, manager = await _sgd_table_saved_by_manager(strategy, str(tmp_path), dim)

        async def step_fn(step: int) -> None:
            await _train(table, opt, step, dim)

        def schedule(start: int, stop: int) -> None:
            for step in range(start, stop):
                coordinator.schedule(step_fn, args=(step,), exactly_once=True)

        schedule(0, 20)
        await coordinator.join()
        await manager.save()
        schedule(20, 40)
        _, index, _ = await asyncio.gather(
            manager.save_delta(), coordinator.add_ps(extra.address), manager.save()
        )
        assert index == 2
        schedule(40, 60)
        await asyncio.gather(coordinator.remove_ps(0), manager.save_delta())
        await coordinator.join()
        assert _ids_on(cluster.ps[0], table.key).size == 0
        path = await manager.save_delta()
        _same_rows(*await table.export(), _expected(60, dim))
        if tiered:
            assert (await table.statistics())["cold_rows"] > 0
    tier = {"tier": str(tmp_path / "tier2")} if tiered else {}
    async with _job(3, extra=False, root=str(tmp_path), **tier) as (cluster, _, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(dim, name="t", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        (await pstrain.checkpoint.Checkpoint(table=table, opt=opt).restore(path)).assert_consumed()
        _same_rows(*await table.export(), _expected(60, dim))


async def _train_sequentially(table, opt, steps: range) -> None:
    for step in steps:
        ids, grads = _batch(step)
        await table.lookup(ids[: BATCH // 2])
        await table.lookup(ids)
        await opt.apply_gradients([(pstrain.IndexedSlices(grads / 4, ids), table)])


async def _adagrad_run(move: bool) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    async with _job() as (cluster, extra, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="items", capacity=5000, admit_after=2, eviction="lfu")
            opt = pstrain.optimizers.Adagrad(0.1)
        await _train_sequentially(table, opt, range(0, 20))
        if move:
            await coordinator.add_ps(extra.address)
            assert _ids_on(extra, table.key).size > 0
        await _train_sequentially(table, opt, range(20, 40))
        if move:
            await coordinator.remove_ps(1)
            assert _ids_on(cluster.ps[1], table.key).size == 0
        await _train_sequentially(table, opt, range(40, 50))
        ids, rows = await table.export()
        slots, freq, sightings = {}, {}, {}
        for ps in [*cluster.ps, extra]:
            shard = ps.tables.get(table.key)
            if shard is None:
                continue
            used = shard._cand_used
            sightings.update(
                (int(i), int(c)) for i, c in zip(shard._cand_ids[:used], shard._cand_counts[:used]) if c
            )
            if len(shard):
                exported = shard.export()
                pos = shard.positions(exported["ids"])
                for i, acc, f in zip(
                    exported["ids"].tolist(), exported[f"slot:{opt.name}/accumulator"], shard.freq[pos]
                ):
                    slots[i], freq[i] = acc, int(f)
        stats = await table.statistics()
        state = np.concatenate(
            [
                rows,
                np.stack([slots[i] for i in ids.tolist()]),
                np.array([[freq[i]] for i in ids.tolist()], np.float32),
            ],
            axis=1,
        )
        return ids, state, {**stats, "sightings": sightings}
    raise AssertionError("unreachable")


async def test_rows_slots_counts_and_sightings_move_exactly():
    """One client, a fixed order of steps: a run with a join and a leave in it ends with
    the same rows, Adagrad accumulators, LFU counts and admission sightings as one without
    (eviction is per shard, so its choices depend on the sharding: not compared)."""
    ids_a, state_a, stats_a = await _adagrad_run(move=False)
    ids_b, state_b, stats_b = await _adagrad_run(move=True)
    np.testing.assert_array_equal(ids_a, ids_b)
    np.testing.assert_array_equal(state_a, state_b)
    assert stats_a["sightings"] and stats_a["sightings"] == stats_b["sightings"]
    assert stats_a["rows"] == stats_b["rows"] == ids_a.size


async def test_an_old_map_request_to_a_table_is_refused_whole_and_a_retry_is_applied_once():
    async with _job() as (cluster, extra, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="t", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        ids = np.sort(POOL[:200])
        await table.lookup(ids)
        # an exactly-once closure's first attempt applies on ps 0 and 1 ...
        set_dispatch(None, "closure-7")
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((200, DIM), np.float32), ids), table)])
        await coordinator.add_ps(extra.address)
        # ... its retry, after slices moved to ps 2, is recognised there and not applied again
        set_dispatch(None, "closure-7")
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((200, DIM), np.float32), ids), table)])
        set_dispatch(None, None)
        _, rows = await table.export()
        np.testing.assert_array_equal(rows, -np.ones((200, DIM), np.float32))
        # a client on the old map is refused by ps 0, applying nothing
        on0 = ids[shard_of(ids, 2) == 0]
        moved = coordinator.ps.table_slices(table)
        away = on0[np.asarray(moved.owners)[shard_of(on0, moved.slices)] == 2]
        assert away.size
        channel = Channel(cluster.ps[0].address, token=cluster.token, task="/job:ps/replica:0/task:0")
        try:
            with pytest.raises(PlacementChangedError) as caught:
                await untyped_call(channel, "dyn/lookup", {"name": table.key, "ids": on0, "train": True})
            assert caught.value.placement["tables"][table.key]["slices"] == moved.slices
        finally:
            await channel.close()
        assert cluster.ps[0].tables[table.key].lookups == 1  # the refused lookup counted nothing
        with pytest.raises(InvalidArgumentError, match="not all on ps 1"):
            await coordinator.ps.move_slices({table.key: [0]}, 1, 0)
        with pytest.raises(InvalidArgumentError, match="not dynamic tables"):
            await coordinator.ps.move_slices({"nope": [0]}, 0, 1)
        await coordinator.remove_ps(0)
        _, rows = await table.export()  # the table itself lives on, on ps 1 and 2
        np.testing.assert_array_equal(rows, -np.ones((200, DIM), np.float32))


async def test_a_table_created_after_a_ps_left_is_sliced_over_the_ps_in_the_job(tmp_path):
    """Ps 1 of 3 leaves before the table exists: the table is made of slices from the
    start, ps 1's on ps 0 and 2, with the whole capacity shared by them; workers route by
    them; a ps that joins takes its share by a move; a checkpoint restores exactly."""
    half = STEPS // 2
    async with _job(3, workers=2, root=str(tmp_path)) as (cluster, extra, strategy, coordinator):
        await coordinator.remove_ps(1)
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(
                DIM, name="late", capacity=100_000, initializer=pstrain.initializers.Zeros()
            )
            opt = pstrain.optimizers.SGD(1.0)
        run = _runner(coordinator, table, opt)

        await run(0, half)
        servers = [*cluster.ps, extra]
        sliced = coordinator.ps.table_slices(table)
        assert set(sliced.owners) == {0, 2} and sliced.slices == 3 * 64
        assert abs(len(sliced.held_by(0)) - len(sliced.held_by(2))) <= 1
        assert table.key not in cluster.ps[1].tables
        _check_map(coordinator, servers, table)
        assert sum(cluster.ps[k].tables[table.key].config.capacity for k in (0, 2)) == 100_000
        _same_rows(*await table.export(), _expected(half))
        manager = pstrain.checkpoint.CheckpointManager(pstrain.Checkpoint(table=table), str(tmp_path))
        await manager.save()
        await run(half, half + 4)
        path = await manager.save_delta()
        # the serving feed of the ps holding it follows base + delta
        mirror = table_feed_example().TableMirror(
            [cluster.ps[k].address for k in (0, 2)], table.key, cluster.token
        )
        async with aiohttp.ClientSession() as session:
            assert await mirror.poll(session) > 0
        ids, rows = mirror.snapshot()
        _same_rows(ids, rows, _expected(half + 4))

        assert await coordinator.add_ps(extra.address) == 3
        await run(half + 4, STEPS)
        sliced = coordinator.ps.table_slices(table)
        assert set(sliced.owners) == {0, 2, 3} and _ids_on(extra, table.key).size > 0
        _check_map(coordinator, servers, table)
        _same_rows(*await table.export(), _expected(STEPS))

        (await pstrain.Checkpoint(table=table).restore(path)).assert_consumed()  # base + delta
        _same_rows(*await table.export(), _expected(half + 4))
        _check_map(coordinator, servers, table)


async def test_a_table_created_after_a_ps_joined_is_spread_over_it_too():
    async with _job() as (cluster, extra, strategy, coordinator):
        assert await coordinator.add_ps(extra.address) == 2
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(
                DIM, name="new", capacity=9_000, initializer=pstrain.initializers.Zeros()
            )
            opt = pstrain.optimizers.SGD(1.0)
        for step in range(10):
            ids, grads = _batch(step)
            await table.lookup(ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])
        servers = [*cluster.ps, extra]
        sliced = coordinator.ps.table_slices(table)
        assert [len(sliced.held_by(k)) for k in range(3)] == [43, 43, 42]
        assert _ids_on(extra, table.key).size > 0
        _check_map(coordinator, servers, table)
        assert sum(ps.tables[table.key].config.capacity for ps in servers) == 9_000
        _same_rows(*await table.export(), _expected(10))
        with pytest.raises(InvalidArgumentError, match="at least the 3 ps"):
            async with strategy.scope():
                pstrain.DynamicEmbedding(DIM, name="tiny", capacity=2)


async def test_a_lost_ps_holding_table_slices_is_replaced_from_base_and_deltas(tmp_path):
    """Ps 1 of 3 is lost after a full save, a delta and three more steps: its slices of the
    table come back on ps 0 and 2 as of the delta, while training goes on; every other row
    keeps all its updates, once."""
    saved, delta, lost, end = 8, 12, 15, 24
    async with _job(3, extra=False, root=str(tmp_path)) as (cluster, _, strategy, coordinator):
        table, opt, manager = await _sgd_table_saved_by_manager(strategy, str(tmp_path))
        run = _runner(coordinator, table, opt)

        await run(0, saved)
        await manager.save()
        await run(saved, delta)
        assert ".delta-" in await manager.save_delta()
        await run(delta, lost)  # these updates on ps 1 are lost with it
        coordinator.replace_lost_ps(manager)
        await cluster.ps[1].stop()
        await run(lost, end)  # the first closures fail on ps 1, are held, and run again

        status = coordinator.statistics()["placement"]
        (replaced,) = status["replaced"]
        assert replaced["ps"] == 1 and replaced["table_rows"] > 0
        assert 1 not in coordinator.ps.table_slices(table).owners
        expected: dict[int, np.ndarray] = {}
        for step in range(end):
            ids, grads = _batch(step)
            for i, g in zip(ids.tolist(), grads):
                if delta <= step < lost and int(shard_of(np.array([i]), 3)[0]) == 1:
                    continue  # on the lost ps after the delta
                expected[i] = expected.get(i, np.zeros(DIM, np.float32)) - g
        _same_rows(*await table.export(), expected)


LOST_BUDGET = 6 << 20


@contextlib.asynccontextmanager
async def _tiered_share_lost(tmp_path) -> AsyncIterator[tuple[Any, Any, Any, Any, Any]]:
    """3 ps with a 6 MiB budget each, a table of 90,000 rows of 64 floats with Adagrad
    saved by a manager, and ps 1 stopped (lost) holding about 30,000 of them (15 MB):
    ``(cluster, coordinator, table, manager, saved)``."""
    ids = np.arange(90_000, dtype=np.int64) * 7
    tier = str(tmp_path / "tier")
    async with _job(3, extra=False, root=str(tmp_path), tier=tier, budget=LOST_BUDGET, segment_rows=4096) as (
        cluster,
        _,
        strategy,
        coordinator,
    ):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(64, name="t")
            opt = pstrain.optimizers.Adagrad(0.1)
        manager = pstrain.CheckpointManager(
            pstrain.Checkpoint(model={"t": table}, optimizer=opt), str(tmp_path / "ck"), max_to_keep=None
        )
        for lo in range(0, ids.size, 5_000):
            part = ids[lo : lo + 5_000]
            await table.lookup(part)
            grad = np.sin(part[:, None] + np.arange(64)).astype(np.float32)
            await opt.apply_gradients([(pstrain.IndexedSlices(grad, part), table)])
        await manager.save()
        saved = await table.export()
        lost = cluster.ps[1].tables[table.key].statistics()["rows"]
        assert lost * 64 * 4 * 2 > 2 * LOST_BUDGET
        await cluster.ps[1].stop()
        yield cluster, coordinator, table, manager, saved
        await manager.close()


async def test_a_lost_tiered_ps_share_larger_than_the_others_budgets_goes_to_their_disks_as_read(tmp_path):
    """The other ps read a lost ps's share from the checkpoint a piece at a time straight to
    their disks, holding a fraction of their budgets in RAM meanwhile (in RAM first, it
    took 34 MB across the two), and every row comes back as saved."""
    async with _tiered_share_lost(tmp_path) as (cluster, coordinator, table, manager, saved):
        tracemalloc.start()
        try:
            await coordinator.replace_ps(1, manager)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < LOST_BUDGET, peak  # (both ps, and the coordinator, together)
        got = await table.export()
        order, want = np.argsort(got[0]), np.argsort(saved[0])
        np.testing.assert_array_equal(got[0][order], saved[0][want])
        np.testing.assert_array_equal(got[1][order], saved[1][want])
        for ps in (cluster.ps[0], cluster.ps[2]):
            assert ps.table_handlers.held() <= ps.store.budget.limit


async def test_a_lost_tiered_ps_share_refused_by_one_ps_leaves_nothing_on_the_other(tmp_path):
    """The replacement refused on ps 2: what ps 0 wrote to its disk for its part dies when
    the replacement is aborted, its own rows as they were."""
    async with _tiered_share_lost(tmp_path) as (cluster, coordinator, table, manager, _):
        shard = cluster.ps[0].tables[table.key]
        rows = shard.statistics()["rows"]
        cluster.ps[2].table_handlers.max_store_bytes = 1
        with pytest.raises(pstrain.errors.ResourceExhaustedError, match="--max-store-bytes"):
            await coordinator.replace_ps(1, manager)
        assert cluster.ps[0].tables[table.key] is shard
        assert shard.statistics()["rows"] == rows and shard.cold.pending == 0


async def test_a_move_whose_switch_is_made_is_done_though_a_ps_cannot_be_told_of_it():
    """Ps 0 is lost (no replacement asked for) before slices of a table move from ps 1 to
    ps 2: the move's switch is made, and ps 0 cannot learn the new map. The move is done,
    not reported as failed (it was not undone): ps 2 serves the slices, every row as
    trained."""
    async with _job(3, extra=False) as (cluster, _, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="t", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        await _runner(coordinator, table, opt)(0, 6)
        moving = coordinator.ps.table_slices(table).held_by(1)
        await cluster.ps[0].stop()
        await coordinator.ps.move_slices({table.key: moving}, 1, 2)
        sliced = coordinator.ps.table_slices(table)
        assert all(sliced.owners[s] == 2 for s in moving)
        assert coordinator.statistics()["placement"]["moves_done"] == 1
        expected = _expected(6)
        ids = np.array(sorted(expected), np.int64)
        ids = ids[np.isin(shard_of(ids, sliced.slices), moving)]  # (ps 0's rows are gone)
        assert ids.size and set(_ids_on(cluster.ps[2], table.key).tolist()) >= set(ids.tolist())
        got = await table.lookup(ids, training=False)
        np.testing.assert_array_equal(got, np.stack([expected[i] for i in ids.tolist()]))


async def test_a_drained_ps_leaves_its_evictions_to_the_next_delta_and_a_restore_matches_the_live_table(
    tmp_path,
):
    """Rows evicted on a ps since the last delta, then the ps drains and leaves: the ps that
    took its slices writes those evictions in the next delta, so base + deltas restored
    into a fresh cluster is the live table, no row missing and none come back."""
    async with _job(3, extra=False, root=str(tmp_path)) as (cluster, _, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="t", max_age=4)
            opt = pstrain.optimizers.Adagrad(0.1)
        manager = pstrain.checkpoint.CheckpointManager(
            pstrain.checkpoint.Checkpoint(table=table, opt=opt), str(tmp_path)
        )
        await _train_sequentially(table, opt, range(0, 10))
        await manager.save()
        await _train_sequentially(table, opt, range(10, 20))
        assert (await table.statistics())["evicted"] > 0
        evicted_on_1 = cluster.ps[1].tables[table.key].evicted
        await coordinator.remove_ps(1)  # drained: its rows and evictions go to ps 0 and 2
        assert evicted_on_1 > 0 and _ids_on(cluster.ps[1], table.key).size == 0
        await _train_sequentially(table, opt, range(20, 22))
        path = await manager.save_delta()
        live_ids, live_rows = await table.export()
    async with _job(extra=False, root=str(tmp_path)) as (cluster, _, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="t", max_age=4)
            opt = pstrain.optimizers.Adagrad(0.1)
        (await pstrain.checkpoint.Checkpoint(table=table, opt=opt).restore(path)).assert_consumed()
        ids, rows = await table.export()
        np.testing.assert_array_equal(ids, live_ids)
        np.testing.assert_array_equal(rows, live_rows)


def test_a_shard_merges_slices_whose_rows_and_slots_changed_between_copy_and_switch():
    """The ps's own steps of a move, on real table shards: rows admitted and an optimizer
    slot made after the copy arrive with the patch; the receiver ends equal to the source."""

    clock = ChangeClock()
    source = DynamicTable("t", TableConfig(dim=DIM, admit_after=2), clock=clock)
    ids = np.sort(POOL[:500])
    source.lookup(ids[:300], True)
    source.lookup(ids[:300], True)  # admitted at the second sighting
    source.lookup(ids[300:], True)  # seen once: sightings only
    everything = SliceSet(slices=4, owned=[0, 1, 2, 3])
    copy = TableCopy(**source.copy_slices(everything))
    mark = clock.mark()
    source.lookup(ids[300:400], True)  # admitted after the copy
    adagrad = {"accumulator": ("opt/accumulator", 0.1)}

    def rule(rows, grad, pos, arrays, cfg, t):
        ok = pos >= 0
        arrays["accumulator"][pos[ok]] += grad[ok] ** 2
        rows[pos[ok]] -= grad[ok]

    source.apply(rule, ids[:400], np.ones((400, DIM), np.float32), adagrad, {}, 1)  # a slot, new
    patch = TablePatch(**source.patch_slices(everything, mark))
    target = DynamicTable("t", TableConfig(dim=DIM, admit_after=2), clock=ChangeClock())
    twice = msgspec.structs.replace(patch, live=np.r_[patch.live, patch.live[:1]])
    twice = msgspec.structs.replace(twice, ages=np.r_[patch.ages, 0], freq=np.r_[patch.freq, 0])
    with pytest.raises(InvalidArgumentError, match="names a moved id twice"):
        target.merge_slices(copy, twice)  # refused whole: nothing put in
    assert len(target) == 0
    assert target.merge_slices(copy, patch) == 400
    got, want = target.export(), source.export()
    order_got, order_want = np.argsort(got["ids"]), np.argsort(want["ids"])
    for key in ("ids", "rows", "slot:opt/accumulator"):
        np.testing.assert_array_equal(got[key][order_got], want[key][order_want])
    target.lookup(ids[400:401], True)  # its second sighting, counted on the source first
    assert len(target) == 401


async def test_a_serving_feed_reader_follows_the_table_as_its_slices_move(tmp_path):
    """examples/table_feed.py's mirror, following every ps: after a join and a drain, at the
    next saved version each ps whose slices changed resets its reader's copy to the slices
    it holds now, so the mirror is the table again (no row twice, none stale)."""
    table_feed = table_feed_example()
    root = str(tmp_path)
    async with _job(root=root, token=TOKEN) as (cluster, extra, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        manager = pstrain.checkpoint.CheckpointManager(
            pstrain.Checkpoint(table=table, opt=opt), root, deltas_per_base=100
        )
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "emb", TOKEN)

        async def same() -> None:
            ids, rows = await table.export()
            got_ids, got_rows = mirror.snapshot()
            np.testing.assert_array_equal(got_ids, ids)
            np.testing.assert_array_equal(got_rows, rows)

        async with aiohttp.ClientSession() as session:
            await _train_sequentially(table, opt, range(0, 5))
            await manager.save()
            await mirror.poll(session)
            await same()
            await coordinator.add_ps(extra.address)
            mirror.endpoints.append(extra.address)
            mirror.shards.append(table_feed.ShardCopy())
            await _train_sequentially(table, opt, range(5, 8))
            await manager.save()  # (a delta cannot cover a ps that joined since the base)
            resets = mirror.resets
            await mirror.poll(session)
            assert mirror.resets == resets + 3  # each ps's slices changed: each one reset
            await same()
            await _train_sequentially(table, opt, range(8, 10))
            await manager.save_delta()
            resets = mirror.resets
            await mirror.poll(session)
            assert mirror.resets == resets  # nothing moved: only the changes
            await same()
            await coordinator.remove_ps(0)
            await _train_sequentially(table, opt, range(10, 12))
            await manager.save_delta()
            await mirror.poll(session)
            assert mirror.shards[0].ids.size == 0  # ps 0 holds no slice now
            await same()


def _stopped(**_):
    raise RuntimeError("the coordinator stopped before step 3")


async def _aborts_nothing(*_, **__):  # a stopped coordinator aborts nothing
    return None


async def _made(strategy: pstrain.ParameterServerStrategy, v: np.ndarray) -> tuple[Any, Any, Any]:
    """A table ``t``, SGD and a variable ``v`` (valued ``v``) on ps 0."""
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(DIM, name="t", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
        with strategy.placement.colocated(0):
            var = pstrain.Variable(v, name="v")
    return table, opt, var


async def _both_stopped(coordinator: Any, table: Any, match: str) -> list[int]:
    """Move ``v`` and two of ps 0's slices of ``table`` to ps 2, each stopped part way (by
    the caller's patches, with ``match``); returns the slices."""
    slices = coordinator.ps.table_slices(table).held_by(0)[:2]
    with pytest.raises(RuntimeError, match=match):
        await coordinator.ps.move(["v"], 2)
    with pytest.raises(RuntimeError, match=match):
        await coordinator.ps.move_slices({table.key: slices}, 0, 2)
    return slices


async def _trained_users(strategy: pstrain.ParameterServerStrategy) -> tuple[Any, Any]:
    """A table ``users`` of TIER_DIM zeros with SGD, trained ``STEPS // 3`` steps."""
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(TIER_DIM, name="users", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
    for step in range(STEPS // 3):
        await _train(table, opt, step, TIER_DIM)
    return table, opt


async def _train(table: Any, opt: Any, step: int, dim: int = DIM) -> None:
    ids, grads = _batch(step, dim)
    await table.lookup(ids)
    await opt.apply_gradients([(pstrain.IndexedSlices(grads, ids), table)])


async def test_a_move_whose_coordinator_stops_after_staging_is_ended_when_its_time_is_up(monkeypatch):
    """A coordinator that stops after staging a move's copies on the new ps (here: its next
    step is never sent, nor an abort) leaves them held there and served by no one: they go
    after MOVE_TTL_S, with the source's marks of the move, and the variable and the table
    are served whole where they were; a later move of them goes through."""

    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, v = await _made(strategy, np.arange(4096, dtype=np.float32))
        async with strategy.scope():
            with strategy.placement.colocated(1):
                w = pstrain.Variable(np.ones(4097, np.float32), name="w")
        await _train(table, opt, 0)
        await coordinator.ps.admit_ps(extra.address)
        monkeypatch.setattr(moves, "MOVE_TTL_S", 2.0)
        monkeypatch.setattr(ps_moves, "FinishMove", _stopped)
        monkeypatch.setattr(ps_moves.PsChanges, "_abort", _aborts_nothing)
        slices = await _both_stopped(coordinator, table, "before step 3")
        source = cluster.ps[0]
        assert len(extra.moves.incoming) == 2 and extra.moves.staged_bytes() >= 4096 * 4
        assert table.key in extra.tables and len(source.moves.outgoing) == 2
        # the staged copies count against the new ps's --max-store-bytes while they are held
        monkeypatch.setattr(extra.moves, "max_store_bytes", extra.moves.staged_bytes() + 4096 * 4)
        with pytest.raises(ResourceExhaustedError, match="max-store-bytes"):
            await coordinator.ps.move(["w"], 2)
        await wait_for(
            lambda: (
                not (
                    extra.moves.incoming
                    or extra.moves.incoming_tables
                    or source.moves.outgoing
                    or source.moves.outgoing_tables
                )
            ),
            timeout=20,
            what="the stopped move's stages ended",
        )
        assert extra.moves.staged_bytes() == 0 and table.key not in extra.tables
        assert extra.moves.statistics()["moves_in_progress"] == 0
        assert source.moves.statistics()["moves_in_progress"] == 0
        np.testing.assert_array_equal(await v.read_value(), np.arange(4096, dtype=np.float32))
        np.testing.assert_array_equal(await w.read_value(), np.ones(4097, np.float32))
        _same_rows(*await table.export(), _expected(1))
        monkeypatch.undo()
        await coordinator.ps.move(["v", "w"], 2)
        await coordinator.ps.move_slices({table.key: slices}, 0, 2)
        assert "v" in {r.name for r in extra.store} and _ids_on(extra, table.key).size
        np.testing.assert_array_equal(await v.read_value(), np.arange(4096, dtype=np.float32))
        np.testing.assert_array_equal(await w.read_value(), np.ones(4097, np.float32))
        _same_rows(*await table.export(), _expected(1))


async def test_a_stopped_moves_time_running_out_leaves_a_later_move_of_the_same_slices_whole(monkeypatch):
    """A coordinator stops after staging a move; another one moves the same variable and
    table slices to the same ps before the first move's time is up. When it is, the end
    of the first move must not undo the second: the table it created there, and the
    slices the second move switched, stay served."""

    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, v = await _made(strategy, np.zeros(64, np.float32))
        await _train(table, opt, 0)
        await coordinator.ps.admit_ps(extra.address)
        with monkeypatch.context() as patch:
            patch.setattr(moves, "MOVE_TTL_S", 5.0)
            patch.setattr(ps_moves, "FinishMove", _stopped)
            patch.setattr(ps_moves.PsChanges, "_abort", _aborts_nothing)
            slices = await _both_stopped(coordinator, table, "before step 3")
        assert len(extra.moves.incoming) == 2
        await coordinator.ps.move(["v"], 2)  # the second moves, whole, before the first's time
        await coordinator.ps.move_slices({table.key: slices}, 0, 2)
        moved = _ids_on(extra, table.key)
        assert moved.size and extra.moves.incoming
        await wait_for(
            lambda: not extra.moves.incoming and not cluster.ps[0].moves.outgoing,
            timeout=20,
            what="the first moves' time up",
        )
        np.testing.assert_array_equal(np.sort(_ids_on(extra, table.key)), np.sort(moved))
        await v.assign_add(np.ones(64, np.float32))  # served by the ps it moved to
        np.testing.assert_array_equal(await v.read_value(), np.ones(64, np.float32))
        assert "v" in {r.name for r in extra.store}
        await _train(table, opt, 1)
        _same_rows(*await table.export(), _expected(2))


async def test_a_coordinator_lost_between_a_moves_switches_is_replaced_and_restores(tmp_path, monkeypatch):
    """The coordinator stops in the milliseconds between the source's switch (step 3: it
    no longer serves the variable and the table slices) and the target's (step 4), so no
    ps serves them. A new coordinator creates them again and restores them from the
    checkpoint, as after any coordinator loss, and trains on. Its takeover drops the
    copies the old one parked on the source; the old one, waking up to undo its move,
    is refused and changes nothing."""

    real = ps_moves.InstallVariables

    def install(**kwargs):
        if kwargs.get("activate"):
            raise RuntimeError("the coordinator stopped between steps 3 and 4")
        return real(**kwargs)

    async def train(v, table, opt, step):
        await _train(table, opt, step)
        await v.assign_add(np.ones(64, np.float32))

    options = {"checkpoint_root": str(tmp_path)}
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options=options) as cluster:
        extra = ParameterServer(2, token=cluster.token, **options)
        await extra.start()
        try:
            strategy = pstrain.ParameterServerStrategy(
                pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
            )
            coordinator = pstrain.ClusterCoordinator(strategy)
            table, opt, v = await _made(strategy, np.zeros(64, np.float32))
            await train(v, table, opt, 0)
            path = await pstrain.Checkpoint(v=v, t=table).save(str(tmp_path / "ckpt"))
            await coordinator.ps.admit_ps(extra.address)
            with monkeypatch.context() as patch:
                patch.setattr(ps_moves, "InstallVariables", install)
                patch.setattr(ps_moves.PsChanges, "_abort", _aborts_nothing)
                await _both_stopped(coordinator, table, "between steps 3 and 4")
            held = {r.name for p in [*cluster.ps, extra] for r in p.store}
            source = cluster.ps[0]
            assert "v" not in held and source.moves.parked  # served by no ps
            old, stages = strategy.placement.owner, list(source.moves.parked)
            del v, table, opt, strategy, coordinator
            gc.collect()  # the old coordinator is gone (a killed chief: nothing closed)
            strategy = pstrain.ParameterServerStrategy(
                pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
            )
            table, opt, v = await _made(strategy, np.zeros(64, np.float32))
            assert table.key == "t"  # the same keys: the dead one's variables are taken over
            await pstrain.Checkpoint(v=v, t=table).restore(path)
            np.testing.assert_array_equal(await v.read_value(), np.ones(64, np.float32))
            _same_rows(*await table.export(), _expected(1))
            await train(v, table, opt, 1)
            np.testing.assert_array_equal(await v.read_value(), np.full(64, 2, np.float32))
            _same_rows(*await table.export(), _expected(2))
            assert not source.moves.parked and not source.moves.parked_tables
            assert source.moves.statistics()["moves_in_progress"] == 0
            channel = Channel(source.address, token=cluster.token, task="/job:ps/replica:0/task:0")
            channel.session.owner = old  # the old coordinator wakes up and undoes its move
            try:
                for stage in stages:
                    with pytest.raises(pstrain.errors.CancelledError, match="newer coordinator"):
                        await channel.request(EndMove(stage=stage, commit=False))
            finally:
                await channel.close()
            np.testing.assert_array_equal(await v.read_value(), np.full(64, 2, np.float32))
            _same_rows(*await table.export(), _expected(2))
        finally:
            await extra.stop()


async def _restarted(cluster: InProcessCluster) -> tuple[Any, Any, tuple[Any, Any, Any]]:
    """A coordinator (started, or started again) with :func:`_made`'s model and a ``w`` on
    ps 0."""
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
    )
    coordinator = pstrain.ClusterCoordinator(strategy)
    made = await _made(strategy, np.zeros(64, np.float32))
    async with strategy.scope():
        with strategy.placement.colocated(0):
            pstrain.Variable(np.zeros(8, np.float32), name="w")
    return strategy, coordinator, made


async def test_a_new_coordinator_moves_onto_a_ps_that_served_the_old_one(tmp_path):
    """A ps joined and took a variable and table slices; the coordinator was lost, and a
    new one restarted on the original cluster file restored the checkpoint. When the new
    one admits that ps again and moves the same variable and slices there, it takes over
    what the old one left there (refused as already there, before), and the ps serves
    exactly the new coordinator's rows. Every ps knows the new coordinator's maps, not the
    old one's (whose versions were higher): a client refused learns where a variable is."""

    root = str(tmp_path)
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options={"checkpoint_root": root}) as cluster:
        extra = ParameterServer(2, token=cluster.token, checkpoint_root=root)
        await extra.start()
        try:
            strategy, coordinator, (table, opt, v) = await _restarted(cluster)
            await _train(table, opt, 0)
            await coordinator.ps.admit_ps(extra.address)
            slices = coordinator.ps.table_slices(table).held_by(0)[:4]
            await coordinator.ps.move(["v"], 2)
            await coordinator.ps.move_slices({table.key: slices}, 0, 2)
            await v.assign_add(np.ones(64, np.float32))
            path = await pstrain.Checkpoint(v=v, t=table).save(str(tmp_path / "ckpt"))
            await _train(table, opt, 1)  # after the save: lost with the old coordinator
            await v.assign_add(np.ones(64, np.float32))
            old = strategy.placement.owner
            del v, table, opt, strategy, coordinator
            gc.collect()  # the old coordinator is gone (a killed chief: nothing closed)

            strategy, coordinator, (table, opt, v) = await _restarted(cluster)
            await pstrain.Checkpoint(v=v, t=table).restore(path)
            assert await coordinator.ps.admit_ps(extra.address) == 2
            await coordinator.ps.move(["v", "w"], 2)
            await coordinator.ps.move_slices({table.key: slices}, 0, 2)
            for ps in [*cluster.ps, extra]:
                assert ps.store.placement == coordinator.ps.placement
            channel = Channel(cluster.ps[0].address, token=cluster.token, task="/job:ps/replica:0/task:0")
            try:  # a client that routes w by its home is told where it is now
                with pytest.raises(PlacementChangedError) as caught:
                    await untyped_call(
                        channel, "vars/assign_add", {"name": "w", "value": np.ones(8, np.float32)}
                    )
                assert caught.value.placement["moved"]["w"] == 2
            finally:
                await channel.close()
            assert extra.store.get("v").owner == strategy.placement.owner != old
            assert extra.tables[table.key].owner == strategy.placement.owner
            np.testing.assert_array_equal(await v.read_value(), np.ones(64, np.float32))
            _same_rows(*await table.export(), _expected(1))
            await _train(table, opt, 1)
            await v.assign_add(np.ones(64, np.float32))
            np.testing.assert_array_equal(await v.read_value(), np.full(64, 2, np.float32))
            _same_rows(*await table.export(), _expected(2))
            _check_map(coordinator, [*cluster.ps, extra], table)
            await coordinator.close()
        finally:
            await extra.stop()


async def test_a_move_whose_new_ps_is_lost_is_undone_and_the_error_says_so(monkeypatch):
    """The ps a move goes to stops in the middle of it (here: just before it would serve
    what moved, step 4 of five). The move is undone: the variable and the table slices are
    served by their source again, nothing is lost, and the error says that, not that a
    ps's variables are lost."""

    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, v = await _made(strategy, np.zeros(64, np.float32))
        await _train(table, opt, 0)
        await coordinator.ps.admit_ps(extra.address)
        channel = coordinator.ps.channel(2)
        real = channel.request

        async def request(op, **kwargs):
            if isinstance(op, InstallVariables) and op.activate:
                await extra.stop()
            return await real(op, **kwargs)

        monkeypatch.setattr(channel, "request", request)
        with pytest.raises(
            pstrain.errors.UnavailableError,
            match=r"moving \['v'\] from ps 0 to ps 2 failed and was undone: ps 0 "
            r"serves them still\. The cause: ",
        ):
            await coordinator.ps.move(["v"], 2)
        slices = coordinator.ps.table_slices(table).held_by(0)[:2]
        with pytest.raises(
            pstrain.errors.UnavailableError,
            match=rf"moving \['{table.key} \(2 slices\)'\] from ps 0 to ps 2 failed "
            r"and was undone: ps 0 serves them still",
        ):
            await coordinator.ps.move_slices({table.key: slices}, 0, 2)
        await v.assign_add(np.ones(64, np.float32))
        np.testing.assert_array_equal(await v.read_value(), np.ones(64, np.float32))
        await _train(table, opt, 1)
        _same_rows(*await table.export(), _expected(2))


async def test_table_slices_a_new_ps_cannot_hold_are_refused_and_stay_where_they_were(monkeypatch):
    """The rows and slots of table slices staged on a new ps count against its
    ``--max-store-bytes`` as variables do: past it the move is refused before anything
    is staged, and the slices are served where they were."""
    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, _ = await _made(strategy, np.zeros(4, np.float32))
        await _train(table, opt, 0)
        await coordinator.ps.admit_ps(extra.address)
        monkeypatch.setattr(extra.moves, "max_store_bytes", extra.store.held() + 64)
        slices = coordinator.ps.table_slices(table).held_by(0)
        with pytest.raises(ResourceExhaustedError, match="max-store-bytes"):
            await coordinator.ps.move_slices({table.key: slices}, 0, 2)
        assert not extra.moves.incoming_tables and table.key not in extra.tables
        assert coordinator.ps.table_slices(table).held_by(0) == slices
        await _train(table, opt, 1)
        _same_rows(*await table.export(), _expected(2))


async def test_the_copies_of_an_aborted_move_go_at_once_not_when_its_time_is_up(monkeypatch):
    """Ending a move as aborted gives the copies staged on the new ps back then: the timer
    that would have ended it holds the stage's name only, not the copies."""

    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, _ = await _made(strategy, np.zeros(1 << 16, np.float32))
        await _train(table, opt, 0)
        await coordinator.ps.admit_ps(extra.address)
        with monkeypatch.context() as patch:
            patch.setattr(ps_moves, "FinishMove", _stopped)
            patch.setattr(ps_moves.PsChanges, "_abort", _aborts_nothing)
            await _both_stopped(coordinator, table, "before step 3")
        staged = [weakref.ref(c.value) for copies in extra.moves.incoming.values() for c in copies]
        staged += [
            weakref.ref(c.rows) for copies in extra.moves.incoming_tables.values() for c, _, _ in copies
        ]
        assert len(staged) == 2
        for stage in list(extra.moves.incoming):
            assert extra.moves.end(EndMove(stage=stage, commit=False, owner=strategy.placement.owner)).ended
        gc.collect()
        assert extra.moves.staged_bytes() == 0 and not [r for r in staged if r() is not None]


@pytest_asyncio.fixture
async def install(ps_server):
    """Sends ``ps/install`` to ``ps_server`` as a coordinator would; after the test, the ps
    must have met no internal error."""
    channel = Channel(ps_server.address, token=TOKEN, task="ps0")

    async def send(**fields: Any) -> Any:
        return await untyped_call(channel, "ps/install", {"stage": "s1", **fields})

    yield send
    await channel.close()
    assert ps_server.internal_errors == 0


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"dim": np.arange(2)}, "dim"),
        ({"dim": 4, "capacity": np.arange(2)}, "capacity"),
        ({"dim": "4"}, "dim"),
        ({"dim": 4, "dtype": "float16"}, "float16"),
        ({"dim": 4, "colour": "red"}, "colour"),
        (np.zeros(3), "object"),
    ],
)
async def test_a_table_copy_whose_config_is_malformed_is_refused_whole(ps_server, install, config, named):
    """ps/install checks the config of a table's copy as dyn/create checks a new table's: a
    wrong field is refused, naming it, and nothing is staged."""
    copy = {
        "name": "t",
        "config": config,
        "moving": {"slices": 4, "owned": [1]},
        "serving": {"slices": 4, "owned": [1]},
        "ids": np.zeros(0, np.int64),
        "rows": np.zeros((0, 4), np.float32),
    }
    with pytest.raises(InvalidArgumentError, match=f"ps/install.*{named}"):
        await install(tables=[copy])
    # the same copy, well formed, is staged
    await install(tables=[{**copy, "config": {"dim": 4}}])
    assert list(ps_server.moves.incoming_tables) == ["s1"]


@pytest.mark.parametrize(
    ("records", "named"),
    [
        ({"records": np.zeros(47, np.uint8)}, "not a whole number of records of 48 bytes"),
        ({"records": np.zeros(12, np.float32)}, "not a vector of bytes"),
        ({"records": np.zeros(2 * 80, np.uint8), "record_slots": ["m", "a"]}, "distinct and sorted"),
        ({"record_slots": ["a"]}, "lists record slots and no records"),
    ],
)
async def test_a_table_copy_whose_records_are_malformed_is_refused_whole(ps_server, install, records, named):
    """The rows a tiered source ships as their records on disk are checked with the copy:
    bytes that are not whole records of the table's layout, or slots out of order, are
    refused naming what is wrong, and nothing is staged; well-formed records are staged."""
    copy = {
        "name": "t",
        "config": {"dim": 4},
        "moving": {"slices": 4, "owned": [1]},
        "serving": {"slices": 4, "owned": [1]},
        "ids": np.zeros(0, np.int64),
        "rows": np.zeros((0, 4), np.float32),
    }
    with pytest.raises(InvalidArgumentError, match=f"ps/install: .*{named}"):
        await install(tables=[{**copy, **records}])
    assert not ps_server.moves.incoming_tables and "t" not in ps_server.tables
    await install(tables=[{**copy, "records": np.zeros(2 * 64, np.uint8), "record_slots": ["acc"]}])
    assert list(ps_server.moves.incoming_tables) == ["s1"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("once", [7]),
        ("once", [["k", 1, ["v"], None]]),  # no table parts
        ("once", [["k", 1, ["v"], None, {"t": [[0, np.arange(2)]]}]]),
        ("fences", [["owner", -1, 2]]),
        ("fences", [np.arange(3)]),
        ("patches", [["v", None]]),
    ],
)
async def test_a_move_activated_with_malformed_records_is_refused_before_anything_is_served(
    ps_server, install, field, value
):
    """The exactly-once records, fences and patches a move's last step carries are checked
    with the request: a malformed one is refused naming its field, the staged copy stays
    staged and unserved, and the same step well formed then serves it."""
    copy = {"name": "v", "value": np.arange(3, dtype=np.float32)}
    await install(vars=[copy])
    with pytest.raises(InvalidArgumentError, match=f"ps/install.*{field}"):
        await install(**{"activate": True, field: value})
    assert "s1" in ps_server.moves.incoming and "v" not in ps_server.store
    await install(activate=True, once=[["k", 1, ["v"], {"t": 1}, {}]], fences=[[None, 0, 2]])
    assert ps_server.store.get("v").array.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("patch", "named"),
    [
        ({"removed": ["a", "b"]}, "removed"),
        (
            {
                "live": np.array([5, 5], np.int64),
                "ages": np.zeros(2, np.int64),
                "freq": np.zeros(2, np.int64),
            },
            "twice",
        ),
        ({"cand_ids": np.array([9], np.int64), "cand_counts": np.array([1, 2], np.int64)}, "cand_counts"),
        ({"ages": np.array([0.5], np.float32)}, "ages"),
        ({"live": [[5], [6, 7]]}, "live"),
    ],
)
async def test_a_move_whose_table_patch_is_malformed_serves_nothing_of_it(ps_server, install, patch, named):
    """The last step of a move checks every table's patch before it serves a variable or
    a row: one malformed part (evicted ids that are not ids, an id twice, sightings without
    their counts) is refused naming it, and neither the variable nor the table's rows
    arrived."""
    ids = np.array([5], np.int64)
    table = {
        "name": "t",
        "config": {"dim": 2},
        "moving": {"slices": 1, "owned": [0]},
        "serving": {"slices": 1, "owned": [0]},
        "ids": ids,
        "rows": np.ones((1, 2), np.float32),
    }
    good = {
        "name": "t",
        "live": ids,
        "ages": np.zeros(1, np.int64),
        "freq": np.zeros(1, np.int64),
        "ids": np.zeros(0, np.int64),
        "rows": np.zeros((0, 2), np.float32),
    }
    await install(vars=[{"name": "v", "value": np.ones(3)}], tables=[table])
    with pytest.raises(InvalidArgumentError, match=f"ps/install.*{named}"):
        await install(activate=True, table_patches=[{**good, **patch}])
    assert "v" not in ps_server.store and len(ps_server.tables["t"]) == 0


async def test_dyn_create_refuses_a_shard_with_slices_and_no_slice_and_creates_nothing():
    async with InProcessCluster(num_ps=1, num_workers=1) as cluster:
        ps = cluster.ps[0]
        channel = Channel(ps.address, token=cluster.token, task="/job:ps/replica:0/task:0")
        try:
            for bad in (
                {"shard": 0, "num_shards": 2, "owned": {"slices": 4, "owned": [1]}},
                {"owned": {"slices": 4, "owned": []}},
            ):
                with pytest.raises(
                    InvalidArgumentError, match="a shard and slices given both, or no slice owned"
                ):
                    await untyped_call(channel, "dyn/create", {"name": "t", "config": {"dim": 2}, **bad})
            assert "t" not in ps.tables
            with pytest.raises(InvalidArgumentError, match="not below 4"):
                await untyped_call(
                    channel,
                    "dyn/create",
                    {"name": "t", "config": {"dim": 2}, "owned": {"slices": 4, "owned": [4]}},
                )
            await untyped_call(
                channel,
                "dyn/create",
                {"name": "t", "config": {"dim": 2}, "owned": {"slices": 4, "owned": [1, 3]}},
            )
            ids = np.arange(200, dtype=np.int64)
            mine = ids[np.isin(shard_of(ids, 4), [1, 3])]
            reply = await untyped_call(channel, "dyn/lookup", {"name": "t", "ids": mine, "train": True})
            assert np.asarray(reply["values"][0]).shape == (mine.size, 2)
            with pytest.raises(PlacementChangedError):  # an id of a slice it does not own
                await untyped_call(channel, "dyn/lookup", {"name": "t", "ids": ids[:20], "train": True})
        finally:
            await channel.close()


async def test_a_moves_copy_crosses_once_from_ps_to_ps_not_through_the_coordinator():
    """The ps that receives slices asks their source for the copy itself (``ps/move_pull``):
    the rows and their slots cross once, ps to ps. The coordinator's steps to the new ps
    carry no rows of the copy, and every row arrives as it was."""
    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(64, name="wide", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.Adagrad(0.5)
        await table.lookup(POOL)
        await opt.apply_gradients(
            [(pstrain.IndexedSlices(np.ones((POOL.size, 64), np.float32), POOL), table)]
        )
        ids, rows = await table.export()
        before = dict(zip(ids.tolist(), rows))
        await coordinator.ps.admit_ps(extra.address)
        slices = coordinator.ps.table_slices(table).held_by(0)
        await coordinator.ps.move_slices({table.key: slices}, 0, 2)
        moved = _ids_on(extra, table.key).size
        copy_bytes = moved * 64 * 4 * 2  # the rows and their Adagrad accumulators
        assert moved > 1000
        out = cluster.ps[0].statistics(None)["requests"]["ps/move_out"]
        into = extra.statistics(None)["requests"]
        assert out["count"] == 1 and out["bytes_out"] >= copy_bytes
        assert into["ps/move_pull"]["count"] == 1 and into["ps/move_pull"]["bytes_in"] < 4096
        assert into["ps/install"]["bytes_in"] < copy_bytes / 4  # the switch: ids and counts only
        ids, rows = await table.export()
        assert sorted(ids.tolist()) == sorted(before)
        assert all(np.array_equal(row, before[i]) for i, row in zip(ids.tolist(), rows))


async def test_a_pull_the_source_refuses_or_cannot_answer_stages_nothing_and_names_the_source():
    """``ps/move_pull`` sent to a ps (as a coordinator would): the source's refusal comes
    back as the pull's, naming the source; a source no one answers at is an
    UnavailableError naming its address. Nothing is staged either way."""
    async with _job() as (cluster, extra, strategy, coordinator):
        assert extra is not None
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(4, name="emb")
        await table.lookup(np.arange(20, dtype=np.int64))
        await coordinator.ps.admit_ps(extra.address)
        channel = Channel(extra.address, token=cluster.token, task="/job:ps/replica:0/task:2")
        source = cluster.ps[0].address
        # ps 0 holds shard 0 of 2: slices 0, 2, 4, 6 of 8; slice 1 is ps 1's
        refused = {"slices": 8, "owned": [1]}
        try:
            with pytest.raises(
                InvalidArgumentError, match=rf"ps/move_pull: .* ps 0 \({source}\).*does not hold"
            ):
                await untyped_call(
                    channel,
                    "ps/move_pull",
                    {
                        "stage": "p1",
                        "source_index": 0,
                        "source_address": source,
                        "keys": [],
                        "tables": {table.key: refused},
                        "serving": {table.key: refused},
                        "owner": strategy.placement.owner,
                    },
                )
            with socket.socket() as bound:  # bound, not listening: connections are refused
                bound.bind(("127.0.0.1", 0))
                nowhere = f"127.0.0.1:{bound.getsockname()[1]}"
                with pytest.raises(pstrain.errors.UnavailableError, match=f"ps/move_pull: .*{nowhere}"):
                    await untyped_call(
                        channel,
                        "ps/move_pull",
                        {
                            "stage": "p2",
                            "source_index": 0,
                            "source_address": nowhere,
                            "keys": [],
                            "owner": strategy.placement.owner,
                        },
                    )
            with pytest.raises(InvalidArgumentError, match="is ps 2: nothing to pull"):
                await untyped_call(
                    channel,
                    "ps/move_pull",
                    {"stage": "p3", "source_index": 2, "source_address": extra.address, "keys": []},
                )
        finally:
            await channel.close()
        assert not extra.moves.incoming and not extra.moves.incoming_tables
        assert not cluster.ps[0].moves.outgoing_tables and extra.internal_errors == 0


async def test_a_tiered_moves_rows_on_disk_are_read_off_the_serving_loop(tmp_path, monkeypatch):
    """The source of a move reads the records of its rows on disk on a thread, a block at
    a time as the new ps pulls them, after the copy's mark: while that read waits, the ps
    serves lookups and updates (of the moving slices too), and the rows changed meanwhile
    reach the new ps with the patch."""
    async with _job(tier=str(tmp_path / "tier")) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt = await _trained_users(strategy)
        assert cluster.ps[0].tables[table.key].statistics()["cold_rows"] > 0
        await coordinator.ps.admit_ps(extra.address)
        reading, release = threading.Event(), threading.Event()
        real = ColdRows.records_from

        def held(self, places):  # the read waits until the test has been served
            reading.set()
            assert release.wait(30)
            return real(self, places)

        monkeypatch.setattr(ColdRows, "records_from", held)
        slices = coordinator.ps.table_slices(table).held_by(0)
        move = asyncio.ensure_future(coordinator.ps.move_slices({table.key: slices}, 0, 2))
        try:
            await wait_for(reading.is_set, timeout=30, what="the copy's read of the rows on disk")
            await _train(table, opt, STEPS // 3, TIER_DIM)  # served while the read waits
        finally:
            release.set()
        await move
        assert _ids_on(extra, table.key).size and not _ids_on(cluster.ps[0], table.key).size
        _same_rows(*await table.export(), _expected(STEPS // 3 + 1, TIER_DIM))


async def test_a_tiered_moves_patch_reads_the_rows_that_reached_its_disk_off_the_serving_loop(
    tmp_path, monkeypatch
):
    """Rows of the moving slices changed after the copy and moved to disk before the switch
    go with the patch, their records read on a thread: while that read waits, the source
    serves what does not move, and no update is lost."""
    async with _job(tier=str(tmp_path / "tier")) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt = await _trained_users(strategy)
        async with strategy.scope():
            probes = [pstrain.Variable(np.full(3, i, np.float32)) for i in range(2)]  # one a ps
        await coordinator.ps.admit_ps(extra.address)
        copying, patching = threading.Event(), threading.Event()
        go_on = {"copy": threading.Event(), "patch": threading.Event()}
        copy_from, read_patch = ColdRows.records_from, TieredSlices._read_patch

        def copy_held(self, places):  # the copy waits while the slices are trained
            copying.set()
            assert go_on["copy"].wait(30)
            return copy_from(self, places)

        def patch_held(self, out, places):
            assert threading.current_thread() is not threading.main_thread()
            patching.set()
            assert go_on["patch"].wait(30)
            return read_patch(self, out, places)

        monkeypatch.setattr(ColdRows, "records_from", copy_held)
        monkeypatch.setattr(TieredSlices, "_read_patch", patch_held)
        slices = coordinator.ps.table_slices(table).held_by(0)
        move = asyncio.ensure_future(coordinator.ps.move_slices({table.key: slices}, 0, 2))
        try:
            await wait_for(copying.is_set, timeout=30, what="the copy's read of the rows on disk")
            for step in range(STEPS // 3, STEPS // 2):  # rows change, and go to disk, after the mark
                await _train(table, opt, step, TIER_DIM)
            go_on["copy"].set()
            await wait_for(patching.is_set, timeout=30, what="the patch's read of the rows on disk")
            for i, v in enumerate(probes):  # served while that read waits
                np.testing.assert_array_equal(await asyncio.wait_for(v.numpy(), 30), np.full(3, i))
        finally:
            for event in go_on.values():
                event.set()
        await move
        assert _ids_on(extra, table.key).size and not _ids_on(cluster.ps[0], table.key).size
        assert cluster.ps[0].tables[table.key].cold.reading == 0
        _same_rows(*await table.export(), _expected(STEPS // 2, TIER_DIM))


async def test_a_tiered_move_is_pulled_a_block_at_a_time_and_neither_ps_holds_the_copy(tmp_path, monkeypatch):
    """A tiered shard's slices move as blocks the new ps pulls and writes to its disk as they
    come: the copy (here some 14 MB, rows in RAM and on disk) is never whole in the memory
    of either ps (both live in this process: what it allocates while the move runs stays a
    fraction of the copy), and the table is exactly as trained, on the new ps."""
    import tracemalloc

    monkeypatch.setattr(moves, "MAX_RECORDS_BYTES", 256 << 10)
    dim, rows = 64, 48_000
    tier = str(tmp_path / "tier")
    async with _job(1, tier=tier, budget=8 << 20, segment_rows=1 << 16) as (
        cluster,
        spare,
        strategy,
        coordinator,
    ):
        assert spare is not None
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(dim, name="items", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        ids = np.arange(rows, dtype=np.int64) * 7919 + 3
        for part in np.array_split(ids, 24):  # (a request's rows must fit the hot set at once)
            await table.lookup(part)
            await opt.apply_gradients(
                [
                    (
                        pstrain.IndexedSlices(
                            np.ones((part.size, dim), np.float32) * (part[:, None] % 5), part
                        ),
                        table,
                    )
                ]
            )
        stats = cluster.ps[0].tables[table.key].statistics()
        assert stats["cold_rows"] > rows // 2 and stats["hot_rows"] > 1000
        copy_bytes = rows * dim * 4
        await coordinator.ps.admit_ps(spare.address)
        pulls = []
        real = CopyStream.read

        def counted(self, start, count, max_bytes):
            pulls.append(start)
            return real(self, start, count, max_bytes)

        monkeypatch.setattr(CopyStream, "read", counted)
        slices = coordinator.ps.table_slices(table).held_by(0)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await coordinator.ps.move_slices({table.key: slices}, 0, 1)
            added = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert len(pulls) > copy_bytes // (256 << 10) // 2 and pulls == sorted(pulls)
        # (a copy held whole would be there twice: the reply sent, and the message received)
        assert added < copy_bytes, f"{added} bytes allocated moving a copy of {copy_bytes}"
        assert spare.moves.pulled == {} and spare.tables[table.key].cold.pending == 0
        assert not _ids_on(cluster.ps[0], table.key).size
        got_ids, got_rows = await table.export()
        order = np.argsort(got_ids)
        np.testing.assert_array_equal(got_ids[order], np.sort(ids))
        np.testing.assert_array_equal(got_rows[order], -np.repeat((np.sort(ids) % 5)[:, None], dim, 1))


async def test_a_tiered_source_lost_while_its_slices_are_pulled_is_replaced_and_loses_one_delta_at_most(
    tmp_path, monkeypatch
):
    """Ps 1, tiered, is lost while a new ps pulls its slices, with replacement on: the move
    fails and is undone, ps 1's slices come back from base + delta on the other ps, and
    training goes on. Its rows lose the steps after the delta at most (those it first saw
    then are gone); every other row keeps all its updates, once."""
    monkeypatch.setattr(moves, "MAX_RECORDS_BYTES", 16 << 10)  # (ps 1's copy: some 9 pulls)
    saved, delta, lost, end = 10, 14, 17, 26
    job = _job(3, tier=str(tmp_path / "tier"), root=str(tmp_path), segment_rows=64)
    async with job as (cluster, spare, strategy, coordinator):
        assert spare is not None
        table, opt, manager = await _sgd_table_saved_by_manager(strategy, str(tmp_path), TIER_DIM)
        run = _runner(coordinator, table, opt, TIER_DIM)
        await run(0, saved)
        await manager.save()
        await run(saved, delta)
        assert ".delta-" in await manager.save_delta()
        await run(delta, lost)  # these updates on ps 1 are lost with it
        assert cluster.ps[1].tables[table.key].statistics()["cold_rows"] > 0
        coordinator.replace_lost_ps(manager)
        sliced = coordinator.ps.table_slices(table)
        on_1, slices = list(sliced.held_by(1)), sliced.slices
        await coordinator.ps.admit_ps(spare.address)
        loop, pulls, read = asyncio.get_running_loop(), [], CopyStream.read

        def pull(self, start, count, max_bytes):  # (on ps 1's reading thread)
            pulls.append(start)
            if len(pulls) == 3:
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(cluster.ps[1].stop()))
            return read(self, start, count, max_bytes)

        monkeypatch.setattr(CopyStream, "read", pull)
        with pytest.raises(pstrain.errors.UnavailableError, match="failed and was undone"):
            await coordinator.ps.move_slices({table.key: on_1}, 1, 3)
        assert len(pulls) == 3
        await run(lost, end)  # the first closures fail on ps 1, are held, and run again

        (replaced,) = coordinator.statistics()["placement"]["replaced"]
        assert replaced["ps"] == 1 and replaced["table_rows"] > 0
        owners = np.asarray(coordinator.ps.table_slices(table).owners)
        assert 1 not in owners
        for k, ps in ((0, cluster.ps[0]), (2, cluster.ps[2]), (3, spare)):  # (each ps as the map says)
            held = _ids_on(ps, table.key)
            assert np.all(owners[shard_of(held, slices)] == k), f"ps {k} holds ids of slices it does not own"
        full: dict[int, np.ndarray] = {}
        kept: dict[int, np.ndarray] = {}  # without the steps between the delta and the loss
        for step in range(end):
            ids, grads = _batch(step, TIER_DIM)
            for i, g in zip(ids.tolist(), grads):
                full[i] = full.get(i, np.zeros(TIER_DIM, np.float32)) - g
                if not delta <= step < lost:
                    kept[i] = kept.get(i, np.zeros(TIER_DIM, np.float32)) - g
        got_ids, got_rows = await table.export()
        got = dict(zip(got_ids.tolist(), got_rows))
        seen = np.array(sorted(full), np.int64)
        was_on_1 = set(seen[np.isin(shard_of(seen, slices), on_1)].tolist())
        rolled_back = 0
        for i, row in full.items():
            if i not in was_on_1:
                assert i in got, f"row {i} is gone"
                np.testing.assert_array_equal(got[i], row)
            elif i not in got:
                assert i not in kept, f"row {i} of ps 1 is gone, though the delta has it"
            elif not np.array_equal(got[i], row):
                np.testing.assert_array_equal(got[i], kept[i])
                rolled_back += 1
        assert rolled_back > 0


async def test_a_disk_that_fills_while_a_move_is_pulled_undoes_it_and_leaves_nothing_behind(
    tmp_path, monkeypatch
):
    """The new ps's disk fills part way through pulling a tiered shard's slices: the move is
    refused with the cause and undone; the blocks it had written there die (nothing pending,
    nothing served there), the source serves every row still, and training goes on exact."""
    monkeypatch.setattr(moves, "MAX_RECORDS_BYTES", 16 << 10)
    async with _job(tier=str(tmp_path / "tier")) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt = await _trained_users(strategy)
        await coordinator.ps.admit_ps(extra.address)
        real = ColdRows.write_records
        written = []

        def filling(self, records, slots):
            if self.directory.startswith(extra.table_handlers.tiering.directory):
                written.append(self)
                if len(written) > 3:
                    raise pstrain.errors.ResourceExhaustedError(
                        f"the table directory {self.directory} is full"
                    )
            return real(self, records, slots)

        monkeypatch.setattr(ColdRows, "write_records", filling)
        slices = coordinator.ps.table_slices(table).held_by(0)
        with pytest.raises(pstrain.errors.ResourceExhaustedError, match="failed and was undone.*is full"):
            await coordinator.ps.move_slices({table.key: slices}, 0, 2)
        assert len(written) == 4  # three blocks written, the fourth refused
        assert written[0].pending == 0 and len(written[0]) == 0  # (its table dropped too)
        assert table.key not in extra.tables
        assert extra.moves.pulled == {} and not extra.moves.incoming_tables
        assert cluster.ps[0].moves.streams == {} and not cluster.ps[0].tables[table.key].saves
        monkeypatch.setattr(ColdRows, "write_records", real)
        for step in range(STEPS // 3, STEPS // 3 + 2):
            await _train(table, opt, step, TIER_DIM)
        _same_rows(*await table.export(), _expected(STEPS // 3 + 2, TIER_DIM))


#: The variables beside the table in the random sequences: of several sizes, so that joins
#: move some of them whole.
DENSE_SIZES = [(4096,), (1024, 4), (300,)]


async def _table_and_variables(strategy: Any, root: str, dim: int) -> tuple[Any, Any, list[Any], Any]:
    """A table ``t`` of zeros with SGD(1.0), variables of zeros, and a CheckpointManager of
    them under ``root``."""
    async with strategy.scope():
        table = pstrain.DynamicEmbedding(dim, name="t", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
        dense = [
            pstrain.Variable(np.zeros(shape, np.float32), name=f"v{k}") for k, shape in enumerate(DENSE_SIZES)
        ]
    ckpt = pstrain.checkpoint.Checkpoint(table=table, opt=opt, **{f"v{k}": v for k, v in enumerate(dense)})
    return table, opt, dense, pstrain.checkpoint.CheckpointManager(ckpt, root)


def _dense_expected(shape: tuple[int, ...], steps: int) -> np.ndarray:
    return np.full(shape, sum(step % 7 - 3 for step in range(steps)), np.float32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tiered", [False, True], ids=["ram", "tiered"])
@pytest.mark.parametrize("seed", range(int(os.environ.get("PSTRAIN_ELASTIC_SEEDS", 3))))
async def test_joins_leaves_saves_and_deltas_in_random_order_and_overlap_lose_nothing(tmp_path, seed, tiered):
    """Random rounds of two or three of: a few training steps (a table and variables), a ps
    joining, one leaving, a full save, a delta, started together; or a ps lost just after
    a delta and replaced from the chain; then a last delta, quiet. The table and the
    variables end exact, the ps that left hold none of the table, and the last delta
    restored onto three other ps is the table and the variables."""
    import random

    rng = random.Random(seed)
    dim = TIER_DIM if tiered else DIM
    tier = {"tier": str(tmp_path / "tier")} if tiered else {}
    done: list[list[str]] = []  # the rounds, for the failure's message
    async with _job(workers=2, root=str(tmp_path), **tier) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        options: dict[str, Any] = {"checkpoint_root": str(tmp_path)}
        if tiered:
            options.update(
                memory_budget=TIER_BUDGET, table_dir=str(tmp_path / "tier"), table_segment_rows=128
            )
        started = [ParameterServer(3 + k, token=cluster.token, **options) for k in range(2)]
        try:
            for server in started:
                await server.start()
            spares = [extra, *started]
            servers = {0: cluster.ps[0], 1: cluster.ps[1]}  # in the job, by index
            gone: list[ParameterServer] = []
            table, opt, dense, manager = await _table_and_variables(strategy, str(tmp_path), dim)

            async def step_fn(step: int) -> None:
                await _train(table, opt, step, dim)
                for v in dense:
                    await v.assign_add(np.full(v.shape, step % 7 - 3, np.float32))

            steps = 0

            async def train(n: int) -> None:
                nonlocal steps
                for step in range(steps, steps + n):
                    coordinator.schedule(step_fn, args=(step,), exactly_once=True)
                steps += n
                await coordinator.join()

            async def join() -> None:
                spare = spares.pop(0)
                servers[await coordinator.add_ps(spare.address)] = spare

            async def leave() -> None:
                index = rng.choice(sorted(servers))
                gone.append(servers.pop(index))
                await coordinator.remove_ps(index)

            async def lose() -> None:
                """A ps lost just after a delta (nothing trained since), replaced from the
                chain: it comes back as it was."""
                index = rng.choice(sorted(servers))
                await manager.save_delta()
                server = servers.pop(index)
                await server.stop()
                await coordinator.replace_ps(index, manager)

            await train(5)
            await manager.save()
            for _ in range(5):
                if len(servers) > 1 and rng.random() < 0.2:
                    done.append(["lose"])
                    await asyncio.wait_for(lose(), 60)
                    continue
                kinds = ["train", "save", "delta"]
                if spares:
                    kinds.append("join")
                if len(servers) > 1:
                    kinds.append("leave")
                chosen = rng.sample(kinds, rng.choice([2, 3]))
                done.append(chosen)
                work = {
                    "train": lambda: train(rng.randrange(3, 10)),
                    "save": manager.save,
                    "delta": manager.save_delta,
                    "join": join,
                    "leave": leave,
                }
                await asyncio.wait_for(asyncio.gather(*(work[kind]() for kind in chosen)), 60)
            path = await manager.save_delta()
            _same_rows(*await table.export(), _expected(steps, dim))
            for v in dense:
                np.testing.assert_array_equal(
                    await v.read_value(), _dense_expected(v.shape, steps), err_msg=str(done)
                )
            assert all(_ids_on(s, table.key).size == 0 for s in gone), done
        finally:
            for server in started:
                await server.stop()
    async with _job(3, extra=False, root=str(tmp_path), **tier) as (cluster, _, strategy, coordinator):
        table, opt, dense, manager = await _table_and_variables(strategy, str(tmp_path), dim)
        (await manager.checkpoint.restore(path)).assert_consumed()
        _same_rows(*await table.export(), _expected(steps, dim))
        for v in dense:
            np.testing.assert_array_equal(await v.read_value(), _dense_expected(v.shape, steps))


async def test_two_ps_leaving_at_once_move_nothing_onto_each_other_and_one_ps_always_stays():
    async with _job(workers=1) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="t", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
            dense = pstrain.Variable(np.arange(8, dtype=np.float32), name="dense")
        for step in range(10):
            await _train(table, opt, step)
        assert await coordinator.add_ps(extra.address) == 2
        await asyncio.gather(coordinator.remove_ps(0), coordinator.remove_ps(1))
        assert _ids_on(cluster.ps[0], table.key).size == 0 and _ids_on(cluster.ps[1], table.key).size == 0
        _same_rows(*await table.export(), _expected(10))
        np.testing.assert_array_equal(await dense.read_value(), np.arange(8, dtype=np.float32))
        assert coordinator.ps.placement.active() == [2]
        with pytest.raises(FailedPreconditionError, match="only ps cannot leave"):
            await coordinator.remove_ps(2)
    async with _job(workers=1, extra=False) as (cluster, _, strategy, coordinator):
        async with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="t", initializer=pstrain.initializers.Zeros())
            opt = pstrain.optimizers.SGD(1.0)
        for step in range(10):
            await _train(table, opt, step)
        got = await asyncio.gather(coordinator.remove_ps(0), coordinator.remove_ps(1), return_exceptions=True)
        refused = [g for g in got if isinstance(g, BaseException)]
        assert len(refused) == 1 and isinstance(refused[0], FailedPreconditionError), got
        assert "would be the last" in str(refused[0])
        assert len(coordinator.ps.placement.active()) == 1
        _same_rows(*await table.export(), _expected(10))


async def test_a_worker_with_an_old_map_finds_a_replaced_ps_through_one_that_left(tmp_path):
    """A worker last routed by the job's first map. Meanwhile a ps joined, ps 0 left (and
    still runs, knowing the map it left by) and ps 1 was lost and replaced from the chain.
    The worker's next request to ps 1 finds it down; ps 0's map is newer than the worker's
    but still sends it to ps 1; the ps that map names are asked in turn, and the newest map
    sends the request where the rows are now."""
    async with _job(workers=1, root=str(tmp_path)) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, manager = await _sgd_table_saved_by_manager(strategy, str(tmp_path))
        run = _runner(coordinator, table, opt)
        await run(0, 10)
        await manager.save()
        assert await coordinator.add_ps(extra.address) == 2
        await coordinator.remove_ps(0)  # (ps 0 keeps running)
        await manager.save_delta()
        await cluster.ps[1].stop()
        await coordinator.replace_ps(1, manager)
        await run(10, 20)  # the worker's first requests since the first map
        _same_rows(*await table.export(), _expected(20))
        assert coordinator.ps.placement.active() == [2]


async def test_a_worker_idle_while_its_only_known_ps_was_replaced_learns_the_map_with_its_closures(tmp_path):
    """The worker last learnt a map in which ps 1 held everything (ps 0 had left, and still
    runs with that map). Then a ps joined and ps 1 was lost and replaced: no ps the worker
    knows can tell it the newest map. The coordinator's batches carry the map when it
    changed since the last one, so the worker's next closures go where the rows are."""
    async with _job(workers=1, root=str(tmp_path)) as (cluster, extra, strategy, coordinator):
        assert extra is not None
        table, opt, manager = await _sgd_table_saved_by_manager(strategy, str(tmp_path))
        run = _runner(coordinator, table, opt)
        await run(0, 10)
        await coordinator.remove_ps(0)  # (ps 0 keeps running)
        await run(10, 20)  # the worker learns the map with ps 1 alone
        await manager.save()
        assert await coordinator.add_ps(extra.address) == 2
        await manager.save_delta()
        await cluster.ps[1].stop()
        await coordinator.replace_ps(1, manager)
        await run(20, 30)
        _same_rows(*await table.export(), _expected(30))
        assert coordinator.ps.placement.active() == [2]
