"""A ps SIGKILLed during W4 training on real processes is replaced from delta checkpoints
while the others train: the job never fails, the ps that lived apply every step exactly
once, and the lost ps's share comes back as of its latest delta, so it loses at most the
updates of about one delta interval (a deterministic counter on each ps says how many).
The same with W6's model: the slices of its DynamicEmbedding the lost ps held come back
on the others."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

import pstrain
from pstrain._formats.messages.operations import ExportTable
from pstrain._formats.numerics.idhash import shard_of
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from pstrain.ctr import CTRModel, make_step, synthetic
from tests.helpers import TOKEN, wait_for

pytestmark = pytest.mark.timeout(240)

ROWS, STEPS, BATCHES, DELTA_S = 30_000, 240, 16, 0.5


@pytest.mark.parametrize("table", ["fixed", "dynamic", "tiered"])
async def test_a_ps_sigkilled_during_w4_is_replaced_from_deltas_while_the_others_train(
    tmp_path, table, drill
):
    """W4 (``dynamic``: W6, its table a DynamicEmbedding whose slices on the lost ps come
    back on the others; ``tiered``: the same on ps that keep part of its rows on disk)."""
    root = str(tmp_path)
    tier = ["--memory-budget", "4MiB", "--table-dir", f"{root}/tier"] if table == "tiered" else []
    servers = [
        drill.serve("--role", "ps", "--index", str(i), "--port", "0", "--checkpoint-root", root, *tier)
        for i in range(3)
    ]
    servers += [drill.serve("--role", "worker", "--index", str(i), "--port", "0") for i in range(2)]
    coordinator = manager = watcher = None
    try:
        spec = {"ps": [s.address for s in servers[:3]], "worker": [s.address for s in servers[3:]]}
        strategy = pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver(spec, token=TOKEN),
            variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(3),
        )
        coordinator = pstrain.ClusterCoordinator(strategy)
        (ids, dense, y), _ = synthetic(BATCHES * 512, 0, rows=ROWS)
        with strategy.scope():
            dynamic = pstrain.DynamicEmbedding(16, name="ctr/dynamic") if table != "fixed" else None
            model = CTRModel(rows=ROWS, table=dynamic)
            opt = pstrain.optimizers.Adagrad(0.05)
            counts = []
            for k in range(3):  # one deterministic update stream per ps: +1 per step
                with strategy.placement.colocated(k):
                    counts.append(pstrain.Variable(np.zeros((), np.int64), name=f"count{k}"))
        inner = make_step(model, opt)

        async def step(k: int) -> float:
            b = k % BATCHES
            loss = await inner(
                iter(
                    [
                        (
                            ids[b * 512 : (b + 1) * 512],
                            dense[b * 512 : (b + 1) * 512],
                            y[b * 512 : (b + 1) * 512],
                        )
                    ]
                )
            )
            for c in counts:
                await c.assign_add(1)
            return loss

        # Retention keeps every save: the test reads the delta the replacement used after
        # training went on (under load, pruning removed it first once).
        manager = CheckpointManager(
            Checkpoint(model=model, opt=opt, counts=counts),
            root,
            max_to_keep=None,
            delta_interval_s=DELTA_S,
            deltas_per_base=10_000,
        )
        await manager.save()
        coordinator.replace_lost_ps(manager)
        done_at: list[float] = []

        async def watch(rvs) -> None:
            for rv in rvs:
                await rv  # every step ends well: none fails because a ps was lost
                done_at.append(time.monotonic())

        watcher = asyncio.ensure_future(
            watch([coordinator.schedule(step, args=(k,), exactly_once=True) for k in range(STEPS)])
        )
        await wait_for(
            lambda: len(done_at) >= STEPS // 4 and ".delta-" in (manager.latest_checkpoint or ""),
            timeout=60.0,
            what="training, and a delta written",
        )
        servers[1].proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        servers[1].proc.wait(10)
        await wait_for(lambda: coordinator.ps.replaced, timeout=60.0, what="ps 1 to be replaced")
        assert len(done_at) < STEPS, "training ended before the replacement"
        await coordinator.join()
        await watcher

        (replaced,) = coordinator.ps.replaced
        assert replaced["ps"] == 1 and ".delta-" in replaced["checkpoint"]
        assert coordinator.ps.status()["ps"][1]["active"] is False
        kept = [int(await counts[k].read_value()) for k in (0, 2)]
        assert kept == [STEPS, STEPS]  # applied once each, across the loss and the retries
        at_delta = int(load_variables(replaced["checkpoint"])["counts/1"])
        lost = STEPS - int(await counts[1].read_value())  # steps ps 1 applied after its delta
        # at most one delta interval's steps (and the time the delta took to write) are lost
        window = [t for t in done_at if killed_at - DELTA_S - 1.0 <= t <= killed_at]
        assert 0 <= lost <= len(window) + 2, (lost, len(window), at_delta)
        gaps = np.diff([t for t in done_at if t >= killed_at - 1.0])
        pause = float(gaps.max()) if gaps.size else 0.0
        assert pause < 10.0, f"training stopped for {pause:.1f} s"
        # the state lives on ps 0 and 2 now, and a checkpoint of it reads back as it is
        placement = coordinator.ps.placement
        assert all(placement.ps_of(k, home) in (0, 2) for k, (home, _) in strategy.placement.placed.items())
        await manager.close()
        last = await manager.save()
        saved = load_variables(last)
        if dynamic is None:
            np.testing.assert_array_equal(saved["model/table"], await model.table.read_value())
        else:  # its rows are on ps 0 and 2, each holding the slices the map gives it
            assert replaced["table_rows"] > 0
            if table == "tiered":  # rows on disk, the lost ps's among them
                stats = await dynamic.statistics()
                assert stats["cold_rows"] > 0 and stats["refused"] == 0, stats
            sliced = coordinator.ps.table_slices(dynamic)
            assert set(sliced.owners) == {0, 2}
            for ps in (0, 2):
                held = (await dynamic.channel(ps).request(ExportTable(name=dynamic.key)))["ids"]
                held = np.asarray(held)
                assert np.all(np.asarray(sliced.owners)[shard_of(held, sliced.slices)] == ps)
        assert int(saved["counts/1"]) == STEPS - lost
        print(
            f"ps 1 replaced in {replaced['seconds']} s from a delta at step {at_delta}; {lost} "
            f"step(s) lost on it; longest pause in training {pause:.2f} s"
        )
    finally:
        if watcher is not None:
            watcher.cancel()
        if manager is not None:
            await manager.close()
        if coordinator is not None:
            await coordinator.close()
