"""The job of the SIGKILL drill (``tests/processes/test_kill_drill.py``): 2 ps and a worker as real
processes, and this process as coordinator, applying a deterministic update stream while
``CheckpointManager`` writes a delta every ``INTERVAL`` seconds (compacting every few), until
the harness SIGKILLs every process.

Step ``k`` (from 0) is one ``opt/apply`` per ps, so each ps applies a step whole or not at
all: plain SGD with learning rate 1 adds 1 to the ps's ``count`` and ``k + 1`` to row
``k % ROWS`` of its ``rows`` variable (1.1 MiB: tracked per row), and ``k + 1`` to table
ids ``k`` and ``HOT + k % 7``. The state of a ps after ``n`` steps is therefore
:func:`expected` of ``n``, whatever moment a save caught. The job prints ``pids [...]``
once, then ``step <k+1> <time>`` after each step.

    python tests/processes/kill_drill_job.py <directory>
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import pstrain

INTERVAL = 0.25  # seconds between deltas
ROWS, DIM, HOT = 72_000, 4, 1_000_000


def build(strategy: pstrain.ParameterServerStrategy):
    """counts and rows (one of each per ps: round-robin placement), a table, the optimizer and
    the checkpoint of them all."""
    with strategy.scope():
        counts = [pstrain.Variable(np.zeros(1, np.float32), name=f"count{p}") for p in range(2)]
        rows = [pstrain.Variable(np.zeros((ROWS, DIM), np.float32), name=f"rows{p}") for p in range(2)]
        table = pstrain.DynamicEmbedding(DIM, name="emb", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
    assert [v.ps_index for v in counts] == [0, 1] and [v.ps_index for v in rows] == [0, 1]
    ckpt = pstrain.Checkpoint(model={"counts": counts, "rows": rows, "emb": table}, optimizer=opt)
    return counts, rows, table, opt, ckpt


async def step(counts, rows, table, opt, k: int) -> None:
    ids = np.array([k, HOT + k % 7], np.int64)  # ascending, unique (k < HOT)
    await table.lookup(ids)
    value = np.float32(k + 1)
    await opt.apply_gradients(
        [(np.full(1, -1.0, np.float32), c) for c in counts]
        + [
            (pstrain.IndexedSlices(np.full((1, DIM), -value, np.float32), np.array([k % ROWS])), r)
            for r in rows
        ]
        + [(pstrain.IndexedSlices(np.full((ids.size, DIM), -value, np.float32), ids), table)]
    )


def expected(n: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """A ps's ``rows`` after ``n`` steps, and the table's row of each id those steps touched."""
    out = np.zeros((ROWS, DIM), np.float32)
    table: dict[int, np.ndarray] = {}
    for k in range(n):
        out[k % ROWS] += k + 1
        for i in {k, HOT + k % 7}:
            table[i] = table.get(i, np.zeros(DIM, np.float32)) + np.float32(k + 1)
    return out, table


async def main(directory: str) -> None:
    async with pstrain.LocalCluster(num_ps=2, num_workers=1, checkpoint_root=directory) as cluster:
        print(
            "pids",
            json.dumps([cluster.pid("ps", 0), cluster.pid("ps", 1), cluster.pid("worker", 0)]),
            flush=True,
        )
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        counts, rows, table, opt, ckpt = build(strategy)
        manager = pstrain.checkpoint.CheckpointManager(
            ckpt, directory, delta_interval_s=INTERVAL, deltas_per_base=4, max_to_keep=2
        )
        await manager.save()  # the base; deltas follow on their own
        k = 0
        while True:
            await step(counts, rows, table, opt, k)
            k += 1
            print(f"step {k} {time.time():.6f}", flush=True)


if __name__ == "__main__":
    pstrain.run(main(sys.argv[1]))
