"""A lost-worker incident can be followed in the logs: the coordinator's dispatch, its
fence, and every ps's fencing name the same cause id (the worker and its lost dispatch,
``cause=w0.d1``), as dask's ``stimulus_id`` does."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

import pstrain
from pstrain._base.tags import cause
from pstrain.testing import InProcessCluster
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)


async def held(v: pstrain.Variable, started: str) -> None:
    """On worker 0: never ends (until the worker goes), once it has made the file
    ``started``; elsewhere: one update."""
    if pstrain.get_current_worker_index() == 0:
        Path(started).touch()
        await asyncio.Event().wait()
    await v.assign_add(1.0)


async def test_a_lost_workers_dispatch_is_named_by_one_cause_in_the_coordinator_and_every_ps(
    caplog, tmp_path
):
    caplog.set_level(logging.INFO, logger="pstrain")
    async with InProcessCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy, max_inflight_per_worker=1)
        with strategy.scope():
            v = pstrain.Variable(0.0)
        await v.numpy()
        started = tmp_path / "started"
        rvs = [coordinator.schedule(held, args=(v, str(started))) for _ in range(4)]
        await wait_for(started.exists, 30, "the closure held on worker 0")
        await cluster.workers[0].stop()
        await wait_for(lambda: coordinator.membership()[0]["failures"] == 1, 30, "worker 0 lost")
        await wait_for(lambda: "refused from now on" in caplog.text, 30, "the ps fenced")
        for rv in rvs[1:]:  # the closures on worker 1; the lost one waits for worker 0 to come back
            try:
                await asyncio.wait_for(_value(rv), 30)
            except pstrain.errors.PstrainError:
                pass
        expected = cause(0, 1)
        said = {
            r.name: re.findall(r"cause=(\S+?)\)", r.getMessage())
            for r in caplog.records
            if "cause=" in r.getMessage()
        }
        assert any(expected in c for n, c in said.items() if n.startswith("pstrain._coordinator")), said
        ps_lines = [
            r for r in caplog.records if r.name == "pstrain.server.ps.fencing" and expected in r.getMessage()
        ]
        assert {r.args[0] for r in ps_lines} == {ps.task for ps in cluster.ps}, ps_lines
        await coordinator.close()


async def _value(rv: pstrain.RemoteValue) -> object:
    return await rv
