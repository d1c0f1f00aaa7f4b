"""Recovery seen from outside: ``pstrain status`` on a running chief, a restarted
coordinator, the sizes each ps shows."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import pstrain
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(90)


async def _status(cluster, tmp_path, chief: str, *args: str):
    """``pstrain status`` of ``cluster`` with its coordinator's endpoint ``chief``."""

    spec = cluster.cluster_spec
    config = tmp_path / "cluster.json"
    config.write_text(
        json.dumps(
            {"cluster": {"chief": [chief], "ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")}}
        )
    )
    token = tmp_path / "token"
    token.write_text(cluster.token)
    return await asyncio.to_thread(
        lambda: subprocess.run(
            [
                sys.executable,
                "-m",
                "pstrain",
                "status",
                "--cluster",
                str(config),
                "--token-file",
                str(token),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    )


async def test_pstrain_status_shows_a_running_chief_up_with_its_closures(cluster, tmp_path):

    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
    chief = await coordinator.serve_metrics()
    for _ in range(3):
        coordinator.schedule(lambda: None)
    await coordinator.join()
    result = await _status(cluster, tmp_path, chief)
    chief_row = next(line for line in result.stdout.splitlines() if line.startswith("chief:0"))
    assert chief_row.split()[1] == "up", result.stdout
    assert "3 done" in chief_row
    assert "foreign" not in result.stdout and result.returncode == 0, result.stdout
    await coordinator.close()


async def test_a_restarted_coordinator_is_not_fenced_out_after_an_earlier_worker_loss(drill):

    cluster = await drill.cluster(num_ps=2, num_workers=2)
    first = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(first, max_inflight_per_worker=4)
    async with first.scope():
        count = pstrain.Variable(0.0, name="count")

    async def incr():
        await asyncio.sleep(0.05)  # the closure's work: some are in flight at the kill
        await count.assign_add(1.0)
        return pstrain.get_current_worker_index()

    rvs = [coordinator.schedule(incr) for _ in range(80)]
    await wait_for(
        lambda: coordinator.queue.in_flight_on(1) > 0, timeout=30, what="closures in flight on worker 1"
    )
    await cluster.kill("worker", 1)  # lost with work in flight: its epoch is fenced off
    await cluster.restart("worker", 1)
    await coordinator.join()
    assert len(rvs) == 80 and coordinator.slots.slot(1).epoch >= 2
    await coordinator.close()  # the coordinator dies; a new one takes the ps over
    rvs.clear()
    gc.collect()

    second = pstrain.ParameterServerStrategy(cluster.resolver)
    second.placement.namespace = ""  # a restarted coordinator: the same keys
    again = pstrain.ClusterCoordinator(second, max_inflight_per_worker=4)
    async with second.scope():
        count = pstrain.Variable(0.0, name="count")
    rvs = [again.schedule(incr) for _ in range(40)]
    await again.join()  # refused from worker 1's dispatch 1 before the fix
    ran_on = {await rv for rv in rvs}
    assert ran_on == {0, 1}
    assert await count.numpy() == 40.0
    await again.close()


async def test_every_size_shown_of_a_ps_counts_its_table_rows(cluster, tmp_path):
    """``pstrain status`` (its table and the placement map) and the dashboard's placement
    panel show what a ps holds, table rows included (8.5 KB was shown for 3.9 MiB held)."""

    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        table = pstrain.DynamicEmbedding(64, name="emb", capacity=100_000)
    await table.lookup(np.arange(16_000, dtype=np.int64))  # about 4 MiB of rows in all
    endpoint = await coordinator.serve_metrics()
    spec = cluster.cluster_spec
    result = await _status(cluster, tmp_path, endpoint, "--coordinator", endpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    held = []
    for line in result.stdout.splitlines():
        if re.match(r"\s*ps:\d|\s*ps \d", line):
            value, unit = re.search(r"([\d.]+) (B|KB|MB|GB)\b", line).groups()
            held.append(float(value) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit])
    num_ps = len(spec.job_tasks("ps"))
    assert len(held) == 2 * num_ps, result.stdout  # the table's rows, and the map's lines
    assert all(h > 16_000 * 64 * 4 / num_ps / 2 for h in held), result.stdout
    state = await pstrain.dashboard.snapshot(coordinator)
    shares = [p["bytes"] for p in state["placement"]["ps"]]
    assert all(s > 16_000 * 64 * 4 / num_ps / 2 for s in shares), shares
    await coordinator.close()
