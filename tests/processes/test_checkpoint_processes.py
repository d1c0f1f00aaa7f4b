"""Checkpoints with real processes: a SIGKILL during a save, an evaluator started by ``pstrain serve``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pstrain
from pstrain.checkpoint import Checkpoint, CheckpointManager, load_variables
from tests.helpers import TOKEN, strategy_for, wait_for

pytestmark = pytest.mark.timeout(90)


async def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(ps_process, tmp_path, drill):
    ps_server = ps_process  # a process: this test blocks its loop reading the saver's output
    script = tmp_path / "saver.py"
    script.write_text(
        textwrap.dedent(f"""
        import numpy as np, pstrain
        from pstrain.checkpoint import Checkpoint, CheckpointManager
        async def main():
            spec = {{"ps": ["{ps_server.address}"], "worker": ["127.0.0.1:9"]}}
            s = pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token="{TOKEN}"))
            async with s.scope():
                big = pstrain.Variable(pstrain.initializers.Ones(), shape=(4_000_000, 8), name="big")
            manager = CheckpointManager(Checkpoint(big=big), "{tmp_path / "run"}", max_to_keep=None)
            await manager.save()
            print("saved", flush=True)
            while True:
                await big.assign_add(np.ones((4_000_000, 8), np.float32))
                await manager.save()
        pstrain.run(main())
    """)
    )
    proc = drill.job([sys.executable, str(script)])
    assert proc.stdout.readline().strip() == "saved"
    run_dir = tmp_path / "run"
    await wait_for(  # a later save is being written
        lambda: any(".tmp" in n for n in os.listdir(run_dir)), timeout=60, what="a save under way"
    )
    proc.kill()  # mid-save
    proc.wait()
    manager = CheckpointManager(None, str(run_dir), max_to_keep=None)
    assert manager.checkpoints  # every visible checkpoint is complete and loads
    for path in manager.checkpoints:
        arrays = load_variables(path)
        assert arrays["big"].shape == (4_000_000, 8) and arrays["big"][0, 0] == arrays["big"][-1, -1]


async def test_evaluator_as_a_serve_role(ps_server, tmp_path):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        w = pstrain.Variable(np.ones(2), name="w")
        opt = pstrain.optimizers.SGD(1.0)
    await opt.apply_gradients([(np.ones(2), w)])
    await CheckpointManager(Checkpoint(w=w, optimizer=opt), str(tmp_path / "run")).save()
    script = tmp_path / "eval.py"
    script.write_text("def evaluate(variables, iterations):\n    return {'w0': float(variables['w'][0])}\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pstrain.cli",
            "serve",
            "--role",
            "evaluator",
            "--checkpoint-dir",
            str(tmp_path / "run"),
            "--eval-script",
            str(script),
            "--max-evaluations",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "ckpt-1 iterations=1 {'w0': 0.0}" in result.stdout
