"""Faults that combine, with tasks that joined: a ps and a worker started with
``pstrain serve --join`` join a job while it trains, the job saves, then its coordinator
is SIGKILLed. A coordinator started again on the same cluster file (which lists neither)
at the same endpoint address restores the checkpoint; the ps and the worker join it by
themselves, the ps takes ``v`` and table slices again, the worker takes a slot beside the
cluster's worker (not over it), and the state is exact. The table feed of each ps, the
joined one included, serves its own rows, under the index the coordinator gave it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest

pytestmark = pytest.mark.timeout(180)

JOB = Path(__file__).resolve().parent / "follow_job.py"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import table_feed  # noqa: E402


async def test_a_ps_and_a_worker_that_joined_join_a_restarted_coordinator_by_themselves(tmp_path, drill):
    from .rejoin_job import IDS

    cluster = await drill.cluster(num_ps=2, num_workers=1, checkpoint_root=tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    env.update(PSTRAIN_TOKEN=cluster.token, PYTHONUNBUFFERED="1")
    spec = cluster.cluster_spec
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")}))
    first = drill.job([sys.executable, str(JOB), "first", str(cluster_file)], env=env, stdin=subprocess.PIPE)
    assert first.stdout is not None
    said = first.stdout.readline().split()
    assert said[0] == "endpoint", said
    endpoint = said[1]
    joining = [
        await asyncio.to_thread(
            drill.serve,
            "--role",
            role,
            "--port",
            "0",
            "--join",
            endpoint,
            "--checkpoint-root",
            str(tmp_path),
            token=cluster.token,
            env=env,
        )
        for role in ("ps", "worker")
    ]
    saved = (await asyncio.to_thread(first.stdout.readline)).split()
    assert saved[0] == "saved", saved
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    again = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(JOB), "again", str(cluster_file), endpoint, saved[1]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    state = json.loads(again.stdout.strip().splitlines()[-1])
    assert state["restored"] == 5.0 and state["v"] == [9.0] * 8
    assert sorted(state["ids"]) == sorted(IDS.tolist())
    np.testing.assert_array_equal(np.asarray(state["rows"]), np.full((IDS.size, 4), -9.0))
    ps_address, worker_address = (p.address for p in joining)
    assert state["ps"] == [*spec.job_tasks("ps"), ps_address]
    assert state["table_owners"] == [0, 1, 2]
    # the worker that joined takes a slot beside the cluster's worker, not over it
    assert [(w["index"], w["address"], w["up"]) for w in state["workers"]] == [
        (0, spec.job_tasks("worker")[0], True),
        (1, worker_address, True),
    ]
    # the feed of each ps serves its own rows: the joined one's too, as ps 2
    mirror = table_feed.TableMirror(state["ps"], "t", cluster.token)
    async with aiohttp.ClientSession() as session:
        await mirror.poll(session)
        # and says it is ps 2 (it was started as ps 0)
        async with session.get(
            f"http://{ps_address}/v1/tables/nope/rows", headers=mirror.headers
        ) as response:
            assert response.status == 404
            assert "not found on /job:ps/replica:0/task:2" in await response.text()
    held = [s.ids.size for s in mirror.shards]
    assert all(held) and sum(held) == IDS.size, held
    got_ids, got_rows = mirror.snapshot()
    np.testing.assert_array_equal(got_ids, np.sort(IDS))
    np.testing.assert_array_equal(got_rows, np.full((IDS.size, 4), -9.0, np.float32))
