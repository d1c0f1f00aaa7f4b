"""The coordinator of ``tests/processes/test_joined_tasks_follow.py``: a real job on the ps and the
worker of ``cluster.json`` (processes), whose endpoint a ps and a worker started with
``pstrain serve --join`` join.

``first``: serve the endpoint, print ``endpoint <address>``, train 3 steps, wait for a ps
and a worker to join (``v`` moves to the ps), train 2 more, save a checkpoint, print
``saved <path>`` and wait to be SIGKILLed, reading stdin. ``again``: a coordinator started
after that on the same cluster file (which lists neither task that joined), serving its
endpoint at the same address: restore ``path``, wait for the two to join it by themselves,
train 4 more steps, save again, and print the state as JSON. Each step subtracts 1 from
every table row of ``IDS`` and adds 1 to ``v`` (``rejoin_job.py``'s model): after the 9
steps each row is -9, ``v`` 9.

    python tests/processes/follow_job.py first cluster.json
    python tests/processes/follow_job.py again cluster.json <endpoint address> <checkpoint path>
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pstrain

if __package__:  # imported by pytest (its doctest pass imports every module)
    from tests.helpers import wait_for

    from .rejoin_job import job
else:  # run as a script, beside them
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
    from rejoin_job import job

    from tests.helpers import wait_for


async def main(role: str, cluster_file: str, *args: str) -> None:
    coordinator, v, table, train = await job(cluster_file)
    port = int(args[0].rsplit(":", 1)[1]) if role == "again" else 0
    endpoint = await coordinator.serve_metrics(port=port)

    def joined() -> bool:  # a third ps holds v, and a second worker took a slot
        placement = coordinator.ps.placement
        return (
            len(placement.active()) == 3
            and coordinator.ps.moving is None
            and placement.moved.get(v.key) == 2
            and len(coordinator.membership()) == 2
        )

    if role == "first":
        print("endpoint", endpoint, flush=True)
        await train(3)
        await wait_for(joined, 60.0, "a ps and a worker to join")
        await train(2)
        path = await pstrain.Checkpoint(v=v, t=table).save(
            os.path.join(os.path.dirname(cluster_file), "ckpt")
        )
        print("saved", path, flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until SIGKILLed (or the harness is gone)
        return
    assert endpoint == args[0], (endpoint, args[0])
    await pstrain.Checkpoint(v=v, t=table).restore(args[1])
    restored = float((await v.numpy())[0])
    await wait_for(joined, 60.0, "the ps and the worker that joined the first coordinator to join")
    await train(4)
    await pstrain.Checkpoint(v=v, t=table).save(os.path.join(os.path.dirname(cluster_file), "ckpt2"))
    ids, rows = await table.export()
    print(
        json.dumps(
            {
                "restored": restored,
                "v": (await v.numpy()).tolist(),
                "ids": ids.tolist(),
                "rows": rows.tolist(),
                "ps": coordinator.ps.placement.ps,
                "table_owners": sorted(set(coordinator.ps.table_slices(table).owners)),
                "workers": coordinator.membership(),
            }
        ),
        flush=True,
    )
    await coordinator.close()


if __name__ == "__main__":
    pstrain.run(main(*sys.argv[1:]))
