"""A ps whose table is past its memory budget (rows on its disk) SIGKILLed while a
checkpoint is being written, or while its slices of the table move to a ps that joined,
then replaced from the base and deltas written before: every row, optimizer slot and
variable comes back exactly as the last complete checkpoint held it, on the ps that are
left, whatever tier each row lands in there."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from pstrain.ctr import CTRModel, make_step, synthetic
from pstrain.rpc import Channel
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(240)

ROWS, BATCHES = 60_000, 12


def _by_id(saved: dict[str, np.ndarray], table: str) -> dict[str, np.ndarray]:
    """``saved`` (``load_variables``) with the table's arrays in the order of its ids."""
    order = np.argsort(saved[f"{table}/ids"], kind="stable")
    return {k: v[order] if k.startswith(table + "/") else v for k, v in saved.items()}


@pytest.mark.parametrize("during", ["save", "move"])
async def test_a_tiered_ps_sigkilled_during_a_save_or_a_move_comes_back_as_the_last_checkpoint(
    tmp_path, drill, during
):
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    tier = ["--memory-budget", "3MiB", "--table-dir", str(tmp_path / "tier")]
    servers = [
        drill.serve("--role", "ps", "--index", str(i), "--port", "0", "--checkpoint-root", root, *tier)
        for i in range(3)
    ]
    servers += [drill.serve("--role", "worker", "--index", str(i), "--port", "0") for i in range(2)]
    spare = drill.serve("--role", "ps", "--index", "3", "--port", "0", "--checkpoint-root", root, *tier)
    spec = {"ps": [s.address for s in servers[:3]], "worker": [s.address for s in servers[3:]]}
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=TOKEN),
        variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(3),
    )
    coordinator = pstrain.ClusterCoordinator(strategy)
    manager = None
    try:
        (ids, dense, y), _ = synthetic(BATCHES * 512, 0, rows=ROWS)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(16, name="ctr/dynamic")
            model = CTRModel(rows=ROWS, table=table)
            opt = pstrain.optimizers.Adagrad(0.05)
        inner = make_step(model, opt)

        async def step(b: int) -> float:
            part = slice(b * 512, (b + 1) * 512)
            return await inner(iter([(ids[part], dense[part], y[part])]))

        async def train(steps: range) -> None:
            for k in steps:
                coordinator.schedule(step, args=(k % BATCHES,))
            await coordinator.join()

        manager = CheckpointManager(
            Checkpoint(model=model, opt=opt), root, max_to_keep=None, deltas_per_base=10_000
        )
        await train(range(BATCHES))
        await manager.save()  # the base
        for k in range(2):  # and two deltas on it
            await train(range(k * 4, k * 4 + 4))
            await manager.save_delta()
        last = manager.latest_checkpoint
        assert last is not None and ".delta-" in last
        stats = await table.statistics()
        assert stats["cold_rows"] > stats["rows"] // 8 and stats["refused"] == 0, stats
        want_ids, want_rows = await table.export()
        want = _by_id(load_variables(last), "model/table")

        coordinator.replace_lost_ps(manager)
        if during == "save":  # a full save, cut short by the kill
            before = {p.name for p in Path(root).rglob("*")}
            cut = asyncio.ensure_future(manager.save())
            await wait_for(
                lambda: cut.done() or any(p.name not in before for p in Path(root).rglob("*")),
                timeout=60.0,
                what="the save to start writing",
            )
        else:  # ps 1's slices of the table moving to a ps that joined, cut short by the kill
            await coordinator.ps.admit_ps(spare.address)
            held = coordinator.ps.table_slices(table).held_by(1)
            cut = asyncio.ensure_future(coordinator.ps.move_slices({table.key: held}, 1, 3))
            source = Channel(servers[1].address, token=TOKEN, task="/job:ps/replica:0/task:1")
            try:

                async def under_way() -> bool:
                    return cut.done() or (await source.statistics())["moves_in_progress"] > 0

                await wait_for(under_way, timeout=60.0, what="the move to start")
            finally:
                await source.close()
        servers[1].proc.send_signal(signal.SIGKILL)
        servers[1].proc.wait(10)
        cut_short = False
        try:
            await cut
        except pstrain.errors.PstrainError:  # (the ps writing its part, or moving, was lost)
            cut_short = True

        async def read(b: int) -> np.ndarray:  # no change: these only find ps 1 lost (its
            # variables, if the table's slices moved away from it before the kill)
            await pstrain.read_variables(model.dense)
            return await table.lookup(np.unique(ids[b * 512 : (b + 1) * 512]), training=False)

        rvs = [coordinator.schedule(read, args=(b,)) for b in range(4)]
        await wait_for(lambda: coordinator.ps.replaced, timeout=90.0, what="ps 1 to be replaced")
        for rv in rvs:
            await rv  # each ran, after the replacement if it failed on the lost ps
        (replaced,) = coordinator.ps.replaced
        assert replaced["ps"] == 1
        # from the last complete checkpoint: the deltas, or the full save if it ended first
        assert replaced["checkpoint"] == last or not cut_short

        got_ids, got_rows = await table.export()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_rows, want_rows)
        stats = await table.statistics()
        assert stats["cold_rows"] > 0 and stats["refused"] == 0, stats
        again = _by_id(load_variables(await manager.save()), "model/table")
        assert set(again) == set(want)
        for key, value in want.items():  # rows, their Adagrad accumulators, the dense layers
            np.testing.assert_array_equal(again[key], value, err_msg=key)
        print(f"killed {'during' if cut_short else 'after'} the {during}: {replaced['checkpoint']}")
    finally:
        if manager is not None:
            await manager.close()
        await coordinator.close()
