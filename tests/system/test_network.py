"""Across real network boundaries: every task in its own network namespace (tests/system/netlab.py).

A worker cut off (alive, partitioned) is declared lost, its closures run elsewhere, and
when the cut heals its late updates are refused by the ps (fencing); a ps cut off fails
the running work with UnavailableError and serves again once healed, without a restart.
Exactly-once closures apply their updates once even when a worker is SIGKILLed mid-run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import pstrain
from pstrain.errors import UnavailableError
from tests.helpers import TOKEN, wait_for

from .netlab import NetLab

pytestmark = pytest.mark.timeout(150)

PORT = 7000


def serve(lab: NetLab, host: str, role: str, index: int, cluster_file: str, log_path: str) -> None:
    env = dict(os.environ, PSTRAIN_TOKEN=TOKEN, PYTHONUNBUFFERED="1")
    for key in ("TF_CONFIG", "PSTRAIN_CONFIG"):
        env.pop(key, None)
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = lab.start(
            host,
            sys.executable,
            "-m",
            "pstrain.cli",
            "serve",
            "--role",
            role,
            "--index",
            str(index),
            "--cluster",
            cluster_file,
            "--host",
            lab.address(host),
            "--port",
            str(PORT),
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            with open(log_path) as f:
                raise AssertionError(f"{role} {index} exited: {f.read()[-2000:]}")
        if re.search(r"listening on ", line):
            return
    raise AssertionError(f"{role} {index} did not start")


@pytest.fixture
def lab(tmp_path):
    with NetLab(["ps0", "w0", "w1"]) as lab:
        spec = {
            "ps": [f"{lab.address('ps0')}:{PORT}"],
            "worker": [f"{lab.address(h)}:{PORT}" for h in ("w0", "w1")],
        }
        cluster_file = tmp_path / "cluster.json"
        cluster_file.write_text(json.dumps({"cluster": spec}))
        for role, index, host in (("ps", 0, "ps0"), ("worker", 0, "w0"), ("worker", 1, "w1")):
            serve(lab, host, role, index, str(cluster_file), str(tmp_path / f"{host}.log"))
        lab.spec = spec
        yield lab


def coordinator_for(lab, **options):
    strategy = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(lab.spec, token=TOKEN))
    settings = dict(max_inflight_per_worker=4, worker_timeout_s=2.0, heartbeat_s=0.25, ps_timeout_s=3.0)
    settings.update(options)
    return strategy, pstrain.ClusterCoordinator(strategy, **settings)


async def test_a_partitioned_worker_is_fenced_off_and_nothing_is_lost(lab):
    strategy, coordinator = coordinator_for(lab)
    async with strategy.scope():
        count = pstrain.Variable(0.0, name="count")

    async def incr():
        await asyncio.sleep(0.05)  # a closure in flight when the cut comes, updating after it
        await count.assign_add(1.0)
        return pstrain.get_current_worker_index()

    rvs = [coordinator.schedule(incr) for _ in range(200)]
    await wait_for(lambda: sum(rv.done() for rv in rvs) >= 40, timeout=30, what="40 closures done")
    lab.cut("w1")
    cut_at = time.monotonic()
    await wait_for(lambda: coordinator.worker_failures >= 1, timeout=10, what="w1 declared lost")
    assert time.monotonic() - cut_at < 5  # the health deadline, not TCP's back-off
    declared = await count.numpy()
    await asyncio.sleep(15 - (time.monotonic() - cut_at))  # a 15 s partition: a fault's duration
    lab.heal("w1")
    await coordinator.join()
    workers = [await rv for rv in rvs]  # every RemoteValue resolves, once
    assert len(workers) == 200
    final = await count.numpy()
    # Closures in flight on w1 when it was declared lost ran again elsewhere: at most that
    # many updates were applied twice (those w1 made before the cut), none after.
    assert 200 <= final <= 200 + 4, final
    assert final - 200 <= max(0.0, declared - sum(1 for w in workers if w is not None) + 200)
    healed = time.monotonic()
    await wait_for(lambda: coordinator.workers_up == [True, True], timeout=10, what="w1 back")
    assert time.monotonic() - healed < 2  # productive again at once, not after TCP back-off
    settled = await count.numpy()
    more = [coordinator.schedule(incr) for _ in range(40)]
    await coordinator.join()
    assert await count.numpy() == settled + 40  # and no late update from the cut ever arrived
    assert {await rv for rv in more} == {0, 1}  # both workers take work again
    await coordinator.close()


async def test_a_partitioned_ps_fails_the_work_then_serves_again_without_a_restart(lab):
    strategy, coordinator = coordinator_for(lab)
    async with strategy.scope():
        v = pstrain.Variable(np.zeros(4, np.float32), name="v")

    async def step():
        await v.assign_add(np.ones(4, np.float32))

    for _ in range(20):
        coordinator.schedule(step)
    await coordinator.join()
    lab.cut("ps0")
    cut_at = time.monotonic()
    for _ in range(20):
        coordinator.schedule(step)
    with pytest.raises(UnavailableError) as info:
        await coordinator.join()
    assert time.monotonic() - cut_at < 10
    assert "partition" in str(info.value) and info.value.task == "/job:ps/replica:0/task:0"
    await asyncio.sleep(15 - (time.monotonic() - cut_at))  # a 15 s partition: a fault's duration
    assert coordinator.done()  # no error left pending by the work that failed
    lab.heal("ps0")
    healed = time.monotonic()
    for _ in range(3):  # productive again: steps complete, with no second error
        coordinator.schedule(step)
        await coordinator.join()
    assert time.monotonic() - healed < 2
    value = (await v.numpy())[0]
    assert value >= 23 and coordinator.done()  # its state survived: 20 before, 3 after, plus any
    await coordinator.close()


async def test_exactly_once_closures_count_exactly_through_a_sigkill():
    async with pstrain.LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=4)
        async with strategy.scope():
            count = pstrain.Variable(0.0, name="count")

        async def incr():
            await count.assign_add(1.0)
            await asyncio.sleep(0.05)  # applied, not yet reported: a kill here means a rerun

        rvs = [coordinator.schedule(incr, exactly_once=True) for _ in range(200)]
        await wait_for(lambda: sum(rv.done() for rv in rvs) >= 60, timeout=60, what="60 done")
        await cluster.kill("worker", 1)
        await coordinator.join()
        assert all(rv.done() for rv in rvs)
        assert coordinator.closures_retried >= 1  # closures did run twice...
        assert await count.numpy() == 200.0  # ...and their updates counted once
        await coordinator.close()
