"""Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group.

Each program runs in a process group of its own (as a shell puts a job in one); the test
sends SIGINT to that group and checks that the steps in flight finish, that one line says
what was kept, that the exit status is 130 and that no process is left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

#: A user's program: steps that take 0.3 s, many queued, a checkpoint after the first ones.
TRAIN = textwrap.dedent("""
    import asyncio, os, sys, time
    import pstrain

    def step(v):
        time.sleep(0.3)
        return v.assign_add(1.0)

    async def main():
        async with pstrain.LocalCluster(num_ps=1, num_workers=2) as cluster:
            print("pids", *(cluster.pid(job, i) for job, n in (("ps", 1), ("worker", 2))
                            for i in range(n)), flush=True)
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            coordinator = pstrain.ClusterCoordinator(strategy)
            with strategy.scope():
                v = pstrain.Variable(0.0, name="v")
            manager = pstrain.checkpoint.CheckpointManager(pstrain.checkpoint.Checkpoint(v=v),
                                                           sys.argv[1])
            await coordinator.schedule(step, args=(v,))
            await manager.save()
            rvs = [coordinator.schedule(step, args=(v,)) for _ in range(400)]
            print("training", flush=True)
            for rv in rvs:
                await rv
            print("finished without an interruption", flush=True)

    pstrain.run(main())
""")


#: The same program as ``pstrain launch`` runs it: the cluster comes from TF_CONFIG.
LAUNCHED = textwrap.dedent("""
    import sys, time
    import pstrain

    def step(v):
        time.sleep(0.3)
        return v.assign_add(1.0)

    async def main():
        strategy = pstrain.ParameterServerStrategy(pstrain.TFConfigClusterResolver())
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0, name="v")
        rvs = [coordinator.schedule(step, args=(v,)) for _ in range(400)]
        print("training", flush=True)
        for rv in rvs:
            await rv
        print("finished without an interruption", flush=True)

    pstrain.run(main())
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd, start_new_session=True)  # its own group, as a shell's job


def _read_until(proc: subprocess.Popen[str], pattern: str) -> list[str]:
    lines = []
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"ended before printing {pattern!r}: {''.join(lines)}"
        lines.append(line)
        if re.search(pattern, line):
            return lines


def _interrupt(proc: subprocess.Popen[str]) -> tuple[int, float, str, str]:
    """Ctrl-C to the process group; (exit status, seconds to exit, rest of stdout, stderr)."""
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, time.monotonic() - t0, out, err


def test_ctrl_c_on_a_users_program_finishes_the_steps_in_flight_and_exits_130(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = _start([sys.executable, str(script), str(tmp_path / "ckpt")], tmp_path)
    try:
        lines = _read_until(proc, "^training")
        pids = [int(p) for p in next(line for line in lines if line.startswith("pids")).split()[1:]]
        time.sleep(0.5)  # let steps be in flight: the point is what happens to them
        code, seconds, out, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130, (code, err)
    assert seconds < 8, seconds  # steps of 0.3 s: well within the 5 s grace, plus the stop
    said = [line for line in err.splitlines() if line.startswith("pstrain: interrupted")]
    assert len(said) == 1, err
    assert re.search(r"(\d+) step\(s\) in flight finished, (\d+) queued step\(s\) cancelled", said[0])
    assert "latest checkpoint " + str(tmp_path / "ckpt" / "ckpt-1") in said[0], said[0]
    assert "Traceback" not in err and "finished without" not in out, err
    wait_for_gone(pids)


def wait_for_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.05)


def test_ctrl_c_on_pstrain_serve_exits_130_with_one_line(tmp_path):
    proc = _start([sys.executable, "-m", "pstrain.cli", "serve", "--role", "ps", "--index", "0",
                   "--port", "0"], tmp_path)
    try:
        _read_until(proc, "listening on")
        code, seconds, _, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130 and seconds < 5, (code, seconds, err)
    said = [line for line in err.splitlines() if "interrupted (Ctrl-C)" in line]
    assert len(said) == 1 and said[0].startswith("pstrain ps:0: interrupted"), err
    assert "Traceback" not in err


def test_ctrl_c_on_pstrain_launch_reaches_the_program_once_and_exits_130(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAUNCHED)
    proc = _start([sys.executable, "-m", "pstrain.cli", "launch", "--ps", "1", "--workers", "2",
                   "--", sys.executable, str(script), str(tmp_path / "ckpt")], tmp_path)
    try:
        _read_until(proc, "training")
        time.sleep(0.5)
        code, seconds, out, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130, (code, out, err)
    assert seconds < 10, seconds
    said = [line for line in out.splitlines() if "pstrain: interrupted (Ctrl-C)" in line]
    assert len(said) == 1 and "in flight finished" in said[0], out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err


def test_ctrl_c_on_pstrain_demo_stops_within_seconds_and_says_what_was_kept(tmp_path):
    proc = _start([sys.executable, "-m", "pstrain.cli", "demo", "--steps", "100000", "--quiet",
                   "--output", str(tmp_path / "demo")], tmp_path)
    try:
        _read_until(proc, "TensorBoard scalars")
        time.sleep(3)  # training, with closures in flight
        code, seconds, out, err = _interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 130, (code, out, err)
    assert seconds < 10, seconds
    said = [line for line in err.splitlines() if line.startswith("pstrain: interrupted")]
    assert len(said) == 1 and "in flight finished" in said[0], err
    assert "Traceback" not in err and "is cancelled" not in err

