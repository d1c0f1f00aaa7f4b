"""SIGKILL of every process at a random moment, then a restore: with deltas written every
``INTERVAL`` seconds, at most about one interval of steps is lost, and what comes back is,
on each ps, exactly the state after a whole number of steps (``kill_drill_job.py``).

The moment is drawn from a seed in the test's output (``PSTRAIN_KILL_SEED=<seed>`` draws it
again)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pstrain
from pstrain._formats.numerics.idhash import shard_of
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, wait_for

from .kill_drill_job import HOT, INTERVAL, build, expected

pytestmark = pytest.mark.timeout(120)

JOB = Path(__file__).resolve().parent / "kill_drill_job.py"


def _progress(log: Path) -> tuple[list[int], list[tuple[int, float]]]:
    pids: list[int] = []
    steps: list[tuple[int, float]] = []
    for line in log.read_text().splitlines():
        if line.startswith("pids "):
            pids = json.loads(line[5:])
        elif line.startswith("step "):
            parts = line.split()
            if len(parts) == 3:  # a line cut by the kill is not a step
                steps.append((int(parts[1]), float(parts[2])))
    return pids, steps


async def test_sigkill_of_every_process_loses_at_most_about_one_delta_interval(tmp_path, drill):
    seed = int(os.environ.get("PSTRAIN_KILL_SEED") or secrets.randbelow(1_000_000))
    print(f"PSTRAIN_KILL_SEED={seed}")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = drill.job([sys.executable, str(JOB), str(directory)], stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        # Run past a compaction (a second base), then kill at a random moment.
        await wait_for(
            lambda: (
                len([f for f in os.listdir(directory) if f.endswith(".index.json") and ".delta-" not in f])
                >= 2
                or job.poll() is not None
            ),
            timeout=60.0,
            what="a second full checkpoint",
        )
        assert job.poll() is None, log.read_text()[-2000:]
        await asyncio.sleep(random.Random(seed).uniform(0, 3 * INTERVAL))  # the moment drawn
        pids = _progress(log)[0]
        for pid in [*pids, job.pid]:  # every process, at once
            os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _, steps = _progress(log)
    assert steps, log.read_text()[-2000:]
    done = steps[-1][0]

    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(directory)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        counts, rows, table, _, ckpt = build(strategy)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, str(directory))
        latest = await manager.restore_or_initialize()
        assert latest is not None  # a delta, or the base a compaction just wrote
        ids, table_rows = await table.export()
        got = {int(i): r for i, r in zip(ids, table_rows)}
        for p in range(2):
            n = int((await counts[p].read_value())[0])
            want_rows, want_table = expected(n)
            # This ps holds exactly the state after n whole steps ...
            np.testing.assert_array_equal(await rows[p].read_value(), want_rows)
            for i, row in want_table.items():
                if shard_of(np.array([i]), 2)[0] == p:
                    np.testing.assert_array_equal(got[i], row)
            touched = {i for i in got if shard_of(np.array([i]), 2)[0] == p}
            extra = touched - set(want_table)  # looked up by step n, not yet applied: still zero
            assert all(not got[i].any() for i in extra) and all(i == n or i == HOT + n % 7 for i in extra)
            # ... and lost no more than the steps of about one interval (a delta's interval,
            # plus the time to write it): every step done 2 intervals before the kill is there.
            before = max((k for k, t in steps if t <= killed_at - 2 * INTERVAL), default=0)
            assert n >= before, (p, n, before, done, seed)
            assert n <= done + 1
