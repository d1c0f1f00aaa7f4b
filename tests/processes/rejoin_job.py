"""The coordinator of ``tests/processes/test_coordinator_after_join.py``: a real job on 2 ps and 2
workers (processes), given in ``cluster.json``; a third ps joins it while it trains.

``first``: train 3 steps, let the ps at ``address`` join (a variable and slices of the
table move to it), train 2 more, save a checkpoint, print ``saved <path> <moved>`` and
wait to be SIGKILLed, reading stdin (``<moved>``: the variables moved, and the ps holding slices of the
table). ``again``: a coordinator started after that, on the same cluster
file (it does not list the ps that joined): restore ``path``, train 4 more steps, print
the state as JSON. Each step subtracts 1 from every table row of ``IDS`` and adds 1 to
``v``: after the 9 steps each row is -9, ``v`` is 9.

    python tests/processes/rejoin_job.py first cluster.json <address of the joining ps>
    python tests/processes/rejoin_job.py again cluster.json <checkpoint path>
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np

import pstrain

IDS = np.arange(1, 400, dtype=np.int64) * 7919


async def job(cluster_file: str):
    """A coordinator on the cluster of ``cluster_file``, ``v`` (on ps 0), table ``t``, and
    ``train(steps)``: each step subtracts 1 from every row of ``IDS`` in ``t`` and adds 1
    to ``v``."""
    with open(cluster_file) as f:
        spec = json.load(f)
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=os.environ["PSTRAIN_TOKEN"])
    )
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        with strategy.placement.colocated(0):
            v = pstrain.Variable(np.zeros(8, np.float32), name="v")
        table = pstrain.DynamicEmbedding(4, name="t", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)

    async def step() -> None:
        await table.lookup(IDS)
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones((IDS.size, 4), np.float32), IDS), table)])
        await v.assign_add(np.ones(8, np.float32))

    async def train(steps: int) -> None:
        for _ in range(steps):
            coordinator.schedule(step)
        await coordinator.join()

    return coordinator, v, table, train


async def main(role: str, cluster_file: str, arg: str) -> None:
    coordinator, v, table, train = await job(cluster_file)
    if role == "first":
        await train(3)
        await coordinator.add_ps(arg)
        await train(2)
        path = await pstrain.Checkpoint(v=v, t=table).save(
            os.path.join(os.path.dirname(cluster_file), "ckpt")
        )
        moved = {
            "moved": coordinator.ps.placement.moved,
            "table_owners": sorted(set(coordinator.ps.table_slices(table).owners)),
        }
        print("saved", path, json.dumps(moved), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until SIGKILLed (or the harness is gone)
        return
    await pstrain.Checkpoint(v=v, t=table).restore(arg)
    restored = float((await v.numpy())[0])
    await train(4)
    ids, rows = await table.export()
    print(
        json.dumps(
            {
                "restored": restored,
                "v": (await v.numpy()).tolist(),
                "ids": ids.tolist(),
                "rows": rows.tolist(),
            }
        ),
        flush=True,
    )
    await coordinator.close()


if __name__ == "__main__":
    pstrain.run(main(*sys.argv[1:4]))
