"""Elastic ps on real processes: during W4 training (its model and data, a smaller table), a
third ``pstrain serve --role ps --join`` process joins and takes a share of the variables,
then SIGTERM drains it and it exits; the final state equals the same training without any
move, bit for bit (one worker, one closure in flight: a deterministic order). The same
with W6's model, whose table is a DynamicEmbedding: slices of its hash space move; and a
table made after the drain lives on the two ps left and trains from the worker process. And
the same on ps that keep part of the table on disk (``--memory-budget``), the joined one
too, where the second table gets its rows in RAM from the first's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain._formats.messages.operations import ExportTable, ListVariables, TableStatistics
from pstrain._formats.numerics.idhash import shard_of
from pstrain.ctr import BATCH, CTRModel, make_step, synthetic
from pstrain.rpc import Channel
from pstrain.testing import InProcessCluster, untyped_call
from tests.helpers import TOKEN, strategy_for, wait_for

pytestmark = pytest.mark.timeout(240)

ROWS, STEPS, BATCHES = 100_000, 500, 24  # step k trains on batch k % BATCHES


def _batches() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    (ids, dense, y), _ = synthetic(BATCHES * BATCH, 0, rows=ROWS)
    return [
        (ids[k * BATCH : (k + 1) * BATCH], dense[k * BATCH : (k + 1) * BATCH], y[k * BATCH : (k + 1) * BATCH])
        for k in range(BATCHES)
    ]


def _build(strategy: pstrain.ParameterServerStrategy, batches, dynamic: bool = False):
    """W4's model (``dynamic``: W6's, its table a DynamicEmbedding), Adagrad, a step."""
    with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="ctr/dynamic", capacity=60_000) if dynamic else None
        model = CTRModel(rows=ROWS, table=table)
        opt = pstrain.optimizers.Adagrad(0.05)
    inner = make_step(model, opt)

    async def step(k: int) -> float:
        return await inner(iter([batches[k % len(batches)]]))

    return model, opt, step


async def _state(model: CTRModel, opt) -> list[np.ndarray]:
    """Every variable, every Adagrad accumulator (read where the map says it is now) and
    the step count."""
    parts = [p for v in [model.table, *model.dense] for p in getattr(v, "variables", [v])]
    values = [await p.read_value() for p in parts]
    for p in parts:
        reply = await untyped_call(
            p.channel(), "vars/read", {"names": [opt.slot_variable_name(p, "accumulator")]}
        )
        values.append(reply["values"][0])
    return values + [await opt.iterations.read_value()]


def _strategy(spec: dict, token: str) -> pstrain.ParameterServerStrategy:
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=token),
        variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2),
    )


async def _reference(batches) -> list[np.ndarray]:
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy = _strategy(cluster.cluster_spec.as_dict(), cluster.token)
        coordinator = pstrain.ClusterCoordinator(strategy)
        model, opt, step = _build(strategy, batches)
        for k in range(STEPS):
            coordinator.schedule(step, args=(k,), exactly_once=True)
        await coordinator.join()
        state = await _state(model, opt)
        await coordinator.close()
        return state


async def _listed(address: str, index: int) -> set[str]:
    channel = Channel(address, token=TOKEN, task=f"/job:ps/replica:0/task:{index}")
    try:
        reply = await channel.request(ListVariables())
        return {v.name for v in reply.variables}
    finally:
        await channel.close()


async def test_a_ps_joins_and_is_drained_by_sigterm_during_w4_and_the_state_is_exact(drill):
    batches = _batches()
    expected = await _reference(batches)
    servers = [drill.serve("--role", "ps", "--index", str(i), "--port", "0") for i in range(2)]
    servers.append(drill.serve("--role", "worker", "--index", "0", "--port", "0"))
    coordinator = watcher = None
    try:
        spec = {"ps": [s.address for s in servers[:2]], "worker": [servers[2].address]}
        strategy = _strategy(spec, TOKEN)
        coordinator = pstrain.ClusterCoordinator(strategy)
        endpoint = await coordinator.serve_metrics()
        model, opt, step = _build(strategy, batches)
        done_at: list[float] = []  # when each step finished
        half = STEPS // 2

        async def watch(rvs) -> None:
            for rv in rvs:
                await rv
                done_at.append(time.monotonic())

        watcher = asyncio.ensure_future(
            watch([coordinator.schedule(step, args=(k,), exactly_once=True) for k in range(half)])
        )
        await wait_for(lambda: len(done_at) >= 4, timeout=60.0, what="training to start")
        joined = await asyncio.to_thread(
            drill.serve, "--role", "ps", "--port", "0", "--join", endpoint, "--drain-timeout", "60"
        )
        await wait_for(
            lambda: coordinator.ps.moves_done >= 1 and coordinator.ps.moving is None,
            timeout=60.0,
            what="a share of the variables to move to the new ps",
        )
        status = coordinator.ps.status()
        assert [p["active"] for p in status["ps"]] == [True, True, True]
        placed = strategy.placement.placed
        for k, address in enumerate(status and [p["address"] for p in status["ps"]]):
            on = {key for key, (home, _) in placed.items() if coordinator.ps.placement.ps_of(key, home) == k}
            held = await _listed(address, k)
            slots = f"{opt.name}/accumulator/"
            assert {n for n in held if not n.startswith(slots)} == on
            trained = on - {opt.iterations.key, opt.iterations_mirror.key}  # counters: no slots
            assert {n for n in held if n.startswith(slots)} == {slots + key for key in trained}
        assert status["ps"][2]["bytes"] > 0
        assert len(done_at) < half, "the moves did not overlap training"
        await watcher
        gaps = list(np.diff(done_at))
        done_at.clear()
        watcher = asyncio.ensure_future(
            watch([coordinator.schedule(step, args=(k,), exactly_once=True) for k in range(half, STEPS)])
        )
        await wait_for(lambda: len(done_at) >= 4, timeout=60.0, what="training on three ps")

        joined.proc.terminate()  # SIGTERM: a preemption notice
        code = await asyncio.to_thread(joined.proc.wait, 90)
        assert code == 0, joined.stderr()
        assert "drained" in joined.stderr()
        # once given its index it logs as what it is now: ps 2, never the ps 0 it started as
        after = joined.stderr().split("as ps 2", 1)
        assert len(after) == 2 and "] INFO" in after[0].splitlines()[-1], joined.stderr()
        assert "[ps:2]" in after[0].splitlines()[-1] and "[ps:0]" not in after[1], joined.stderr()
        assert coordinator.ps.status()["ps"][2]["active"] is False
        assert coordinator.ps.shares().get(2, 0) == 0
        assert len(done_at) < STEPS - half, "the drain did not overlap training"
        await coordinator.join()
        await watcher
        state = await _state(model, opt)
        for got, want in zip(state, expected):
            np.testing.assert_array_equal(got, want)
        gaps += list(np.diff(done_at))
        assert max(gaps) < 2.0, f"training stopped for {max(gaps):.2f} s"
    finally:
        if watcher is not None:
            watcher.cancel()
        if coordinator is not None:
            await coordinator.close()


# -- a dynamic table (W6's model) ---------------------------------------------------------------
TABLE_STEPS = 240


async def _rows_match_the_map(coordinator, table) -> None:
    """Each ps holds exactly the ids of the slices the placement map gives it (read from the
    ps processes themselves)."""
    sliced = coordinator.ps.table_slices(table)
    owners = np.asarray(sliced.owners)
    for ps in sorted(set(sliced.owners)):
        ids = np.asarray((await table.channel(ps).request(ExportTable(name=table.key)))["ids"])
        assert ids.size and np.all(owners[shard_of(ids, sliced.slices)] == ps), ps


async def _table_state(model: CTRModel, opt) -> list[np.ndarray]:
    """The table's ids, rows and Adagrad accumulators (from every ps holding part of it, in
    id order), the dense variables and the step count."""
    table = model.table
    ids, rows, accs = [], [], []
    for ps in table.holders():
        reply = await table.channel(ps).request(ExportTable(name=table.key))
        ids.append(np.asarray(reply["ids"]))
        rows.append(np.asarray(reply["rows"]).reshape(-1, table.dim))
        accs.append(np.asarray(reply["slots"][f"{opt.name}/accumulator"]).reshape(-1, table.dim))
    order = np.argsort(np.concatenate(ids))
    values = [np.concatenate(ids)[order], np.concatenate(rows)[order], np.concatenate(accs)[order]]
    return values + [await v.read_value() for v in model.dense] + [await opt.iterations.read_value()]


@pytest.mark.parametrize("tiered", [False, True], ids=["in-ram", "tiered"])
async def test_a_dynamic_table_moves_to_a_joining_ps_and_off_it_on_sigterm_and_the_state_is_exact(
    drill, tiered, tmp_path
):
    """``tiered``: every ps keeps part of the table on disk (a budget of 8 MiB, about half
    the rows of its share), the joined one too."""
    tier = ["--memory-budget", "8MiB", "--table-dir", str(tmp_path / "tier")] if tiered else []
    batches = _batches()
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy = _strategy(cluster.cluster_spec.as_dict(), cluster.token)
        coordinator = pstrain.ClusterCoordinator(strategy)
        model, opt, step = _build(strategy, batches, dynamic=True)
        for k in range(TABLE_STEPS):
            coordinator.schedule(step, args=(k,), exactly_once=True)
        await coordinator.join()
        expected = await _table_state(model, opt)
        # no eviction (per shard: its choices would depend on the sharding); the capacity's
        # shares move with the slices all the same
        assert (await model.table.statistics())["evicted"] == 0
        await coordinator.close()
    servers = [drill.serve("--role", "ps", "--index", str(i), "--port", "0", *tier) for i in range(2)]
    servers.append(drill.serve("--role", "worker", "--index", "0", "--port", "0"))
    coordinator = None
    try:
        spec = {"ps": [s.address for s in servers[:2]], "worker": [servers[2].address]}
        strategy = _strategy(spec, TOKEN)
        coordinator = pstrain.ClusterCoordinator(strategy)
        endpoint = await coordinator.serve_metrics()
        model, opt, step = _build(strategy, batches, dynamic=True)
        rvs = [coordinator.schedule(step, args=(k,), exactly_once=True) for k in range(TABLE_STEPS)]
        await wait_for(lambda: coordinator.closures_done >= 10, timeout=60.0, what="training to start")
        joined = await asyncio.to_thread(
            drill.serve, "--role", "ps", "--port", "0", "--join", endpoint, "--drain-timeout", "60", *tier
        )
        await wait_for(
            lambda: (
                2 in set(coordinator.ps.table_slices(model.table).owners) and coordinator.ps.moving is None
            ),
            timeout=60.0,
            what="a share of the table to move to the new ps",
        )
        on_new = await model.table.channel(2).request(TableStatistics(name=model.table.key))
        assert on_new["rows"] > 0
        if tiered:  # the slices it took came with their rows on disk, and stay there
            assert on_new["cold_rows"] > 0, on_new
        await _rows_match_the_map(coordinator, model.table)
        await wait_for(
            lambda: coordinator.closures_done >= TABLE_STEPS // 2, timeout=60.0, what="training on three ps"
        )
        joined.proc.terminate()  # SIGTERM: a preemption notice
        code = await asyncio.to_thread(joined.proc.wait, 90)
        assert code == 0, joined.stderr()
        assert 2 not in coordinator.ps.table_slices(model.table).owners
        await _rows_match_the_map(coordinator, model.table)
        assert coordinator.closures_done < TABLE_STEPS, "the moves did not overlap training"
        await coordinator.join()
        for rv in rvs:
            await rv
        state = await _table_state(model, opt)
        assert len(state) == len(expected)
        for got, want in zip(state, expected):
            np.testing.assert_array_equal(got, want)
        # (tiered: the first table's rows in RAM filled each ps's budget; it gives some back)
        await _a_table_made_after_the_drain_trains_on_the_ps_left(strategy, coordinator)
    finally:
        if coordinator is not None:
            await coordinator.close()


async def _a_table_made_after_the_drain_trains_on_the_ps_left(strategy, coordinator) -> None:
    """A table made once ps 2 has been drained and has exited: its slices are on ps 0 and
    1 only, and a closure on the worker process looks it up and updates it."""
    with strategy.scope():
        later = pstrain.DynamicEmbedding(4, name="after/drain")
        sgd = pstrain.optimizers.SGD(0.5)
    ids = np.arange(1, 2001, dtype=np.int64) * 7919

    async def train() -> np.ndarray:
        values = await later.lookup(ids)
        await sgd.apply_gradients([(pstrain.IndexedSlices(np.ones((ids.size, 4), np.float32), ids), later)])
        return values

    before = await coordinator.schedule(train)
    assert before.shape == (ids.size, 4)
    assert set(later.holders()) == {0, 1}
    assert set(coordinator.ps.table_slices(later).owners) == {0, 1}
    np.testing.assert_array_equal(await later.lookup(ids, training=False), before - 0.5)
    assert (await later.statistics())["rows"] == ids.size


async def test_a_ps_sigkilled_while_it_pulls_a_tiered_shard_leaves_the_move_undone_and_every_row_served(
    drill, tmp_path
):
    """A ps that joined is SIGKILLed while it pulls a tiered shard's slices, block by block,
    onto its disk: the move fails and is undone, the source holds no copy open (its hot set
    and segments are its own again) and serves every row as trained, and training goes on."""
    tier = ["--memory-budget", "16MiB", "--table-dir", str(tmp_path / "tier")]
    ps = [
        await asyncio.to_thread(drill.serve, "--role", "ps", "--index", str(i), "--port", "0", *tier)
        for i in range(2)
    ]
    spare = await asyncio.to_thread(drill.serve, "--role", "ps", "--index", "2", "--port", "0", *tier)
    strategy = strategy_for(*ps)
    coordinator = pstrain.ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            table = pstrain.DynamicEmbedding(64, name="big", initializer=pstrain.initializers.Zeros())
            sgd = pstrain.optimizers.SGD(1.0)
        ids = np.arange(240_000, dtype=np.int64) * 7919 + 11

        async def train(part: np.ndarray) -> None:
            await table.lookup(part)
            grads = np.repeat((part % 5)[:, None], 64, 1).astype(np.float32)
            await sgd.apply_gradients([(pstrain.IndexedSlices(grads, part), table)])

        for part in np.array_split(ids, 30):
            await train(part)
        await coordinator.ps.admit_ps(spare.address)
        mine = Path(tmp_path / "tier")
        move = asyncio.ensure_future(
            coordinator.ps.move_slices({table.key: coordinator.ps.table_slices(table).held_by(0)}, 0, 2)
        )

        def pulling() -> bool:  # a block written on the new ps's disk
            return any(f.stat().st_size for f in mine.glob(f"pstrain-{spare.proc.pid}-*/*/*.rec"))

        await wait_for(pulling, timeout=60, what="the new ps to write the first blocks it pulled")
        spare.proc.kill()
        with pytest.raises(pstrain.errors.PstrainError, match="failed and was undone"):
            await move
        source = Channel(ps[0].address, token=TOKEN, task="/job:ps/replica:0/task:0")
        try:

            async def let_go() -> bool:
                return (await source.statistics())["moves_in_progress"] == 0

            await wait_for(let_go, timeout=30, what="the source to end the move")
            stats = await source.request(TableStatistics(name=table.key))
        finally:
            await source.close()
        assert stats["cold_rows"] > 0 and 2 not in coordinator.ps.table_slices(table).owners
        got_ids, got_rows = await table.export()
        order = np.argsort(got_ids)
        np.testing.assert_array_equal(got_ids[order], np.sort(ids))
        np.testing.assert_array_equal(got_rows[order], -np.repeat((np.sort(ids) % 5)[:, None], 64, 1))
        await train(ids[:1000])  # (and training goes on)
        np.testing.assert_array_equal(
            await table.lookup(ids[:1000], training=False), -2 * np.repeat((ids[:1000] % 5)[:, None], 64, 1)
        )
    finally:
        await coordinator.close()
