"""Faults that combine, with elastic ps: a ps joins a job while it trains (a variable and
table slices move to it), the job saves, then its coordinator is SIGKILLed. A coordinator
started again on the same cluster file (which does not list the ps that joined) restores
the checkpoint and trains on with the same long-lived workers: its state is exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(180)

JOB = Path(__file__).resolve().parent / "rejoin_job.py"


async def test_a_coordinator_killed_after_a_ps_joined_is_started_again_and_trains_exactly(tmp_path, drill):
    cluster = await drill.cluster(num_ps=2, num_workers=2, checkpoint_root=tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    env.update(PSTRAIN_TOKEN=cluster.token, PYTHONUNBUFFERED="1")
    joining = drill.serve(
        "--role",
        "ps",
        "--index",
        "2",
        "--port",
        "0",
        "--checkpoint-root",
        str(tmp_path),
        token=cluster.token,
        env=env,
    )
    spec = cluster.cluster_spec
    (tmp_path / "cluster.json").write_text(
        json.dumps({"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")})
    )
    first = drill.job(
        [sys.executable, str(JOB), "first", str(tmp_path / "cluster.json"), joining.address],
        env=env,
        stdin=subprocess.PIPE,
    )
    assert first.stdout is not None
    saved = first.stdout.readline().split(maxsplit=2)
    assert saved[0] == "saved", saved
    # v and slices of the table live on the ps that joined
    assert json.loads(saved[2]) == {"moved": {"v": 2}, "table_owners": [0, 1, 2]}
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    again = subprocess.run(
        [sys.executable, str(JOB), "again", str(tmp_path / "cluster.json"), saved[1]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    state = json.loads(again.stdout.strip().splitlines()[-1])
    from .rejoin_job import IDS

    assert state["restored"] == 5.0 and state["v"] == [9.0] * 8
    assert sorted(state["ids"]) == sorted(IDS.tolist())
    np.testing.assert_array_equal(np.asarray(state["rows"]), np.full((IDS.size, 4), -9.0))
