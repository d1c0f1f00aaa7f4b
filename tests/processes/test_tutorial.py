"""TF's parameter-server tutorial (custom training loop), ported: it starts cleanly 50 times in
a row with plain ``with strategy.scope()``, and a coordinator killed mid-training and started
again against the same running ps and workers restores the latest checkpoint and finishes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import pstrain
from pstrain.checkpoint import CheckpointManager, load_variables
from pstrain.testing import InProcessCluster

pytestmark = pytest.mark.timeout(240)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import tf_tutorial  # noqa: E402


async def test_the_tutorial_starts_cleanly_fifty_times_in_a_row(tmp_path):
    async with InProcessCluster(
        num_ps=2, num_workers=2, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        for start in range(50):
            run_dir = str(tmp_path / f"run{start}")
            loss = await asyncio.wait_for(
                tf_tutorial.train(cluster.resolver, run_dir, epochs=1, steps_per_epoch=2, quiet=True),
                timeout=30,
            )  # a livelocked start would spin here: fail, do not hang
            assert 0 < loss < 1.0, start
            assert CheckpointManager(None, run_dir).latest_checkpoint.endswith("ckpt-1")


async def test_a_killed_coordinator_restarts_restores_and_finishes(tmp_path):
    run_dir = tmp_path / "run"
    async with pstrain.LocalCluster(num_ps=2, num_workers=2, checkpoint_root=tmp_path) as cluster:
        env = dict(
            os.environ,
            PSTRAIN_CONFIG=json.dumps(cluster.config()),
            PSTRAIN_TOKEN=cluster.token,
            PYTHONUNBUFFERED="1",
        )
        env.pop("TF_CONFIG", None)
        cmd = [
            sys.executable,
            str(EXAMPLES / "tf_tutorial.py"),
            "--epochs",
            "6",
            "--steps-per-epoch",
            "10",
            "--run-dir",
            str(run_dir),
        ]
        first = await asyncio.create_subprocess_exec(
            *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            while True:  # train until two epochs are saved, then kill -9 mid-training
                line = (await asyncio.wait_for(first.stdout.readline(), 120)).decode()
                assert line, "the first coordinator ended before its second checkpoint"
                if "saved ckpt-2" in line:
                    break
        finally:
            first.send_signal(signal.SIGKILL)
            await first.wait()
        second = await asyncio.get_running_loop().run_in_executor(
            None, lambda: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        )
        assert second.returncode == 0, second.stderr[-3000:]
        out = second.stdout
        resumed = re.search(r"restored ckpt-(\d+): continuing at epoch (\d+)", out)
        assert resumed and int(resumed.group(1)) >= 2 and resumed.group(1) == resumed.group(2), out
        assert "Finished epoch 5" in out and "Final loss" in out
        # every step of the finished epochs counted once, plus the final loss step
        assert "iterations 61" in out, out
        saved = load_variables(CheckpointManager(None, str(run_dir)).latest_checkpoint)
        assert int(saved["epoch"]) == 6 and int(saved["optimizer/iterations"]) == 60
