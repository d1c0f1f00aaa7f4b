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
from collections.abc import Callable
from pathlib import Path

import pytest

from pstrain.checkpoint import load_variables

pytestmark = pytest.mark.timeout(120)

#: A user's program: steps that take 0.3 s, many queued, a checkpoint after the first one. On
#: its own it starts its cluster; under ``pstrain launch`` (a second argument) the cluster
#: comes from PSTRAIN_CONFIG.
TRAIN = textwrap.dedent("""
    import sys, time
    import pstrain

    def step(v):
        time.sleep(0.3)
        return v.assign_add(1.0)

    async def train(resolver):
        strategy = pstrain.ParameterServerStrategy(resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0, name="v")
        manager = pstrain.checkpoint.CheckpointManager(pstrain.checkpoint.Checkpoint(v=v),
                                                       sys.argv[1])
        await coordinator.schedule(step, args=(v,))
        await manager.save()
        rvs = [coordinator.schedule(step, args=(v,)) for _ in range(400)]
        await rvs[0]
        print("stepping", flush=True)  # from here on, steps are in flight
        for rv in rvs:
            await rv
        print("finished without an interruption", flush=True)

    async def main():
        if len(sys.argv) > 2:
            await train(pstrain.TFConfigClusterResolver())
            return
        async with pstrain.LocalCluster(num_ps=1, num_workers=2) as cluster:
            print("pids", *(cluster.pid(job, i) for job, n in (("ps", 1), ("worker", 2))
                            for i in range(n)), flush=True)
            await train(cluster.resolver)

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
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )  # its own group, as a shell's job


def _read_until(proc: subprocess.Popen[str], pattern: str) -> list[str]:
    lines = []
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"ended before printing {pattern!r}: {''.join(lines)}"
        lines.append(line)
        if re.search(pattern, line):
            return lines


def _interrupt_when(
    args: list[str], cwd: Path, ready: str, also: Callable[[], bool] = lambda: True
) -> tuple[int, float, list[str], str, str]:
    """Start ``args`` as a job of its own, wait for a line matching ``ready`` (and ``also()``),
    then Ctrl-C it as a terminal does. (exit status, seconds to exit, the lines before,
    the rest of stdout, stderr); nothing is left running."""
    proc = _start(args, cwd)
    try:
        lines = _read_until(proc, ready)
        deadline = time.monotonic() + 60
        while not also():
            assert time.monotonic() < deadline, "the job never got ready"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        return proc.returncode, time.monotonic() - t0, lines, out, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _said(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if prefix in line]


def test_ctrl_c_on_a_users_program_finishes_the_steps_in_flight_and_exits_130(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    code, seconds, lines, out, err = _interrupt_when(
        [sys.executable, str(script), str(tmp_path / "ckpt")], tmp_path, "^stepping"
    )
    assert code == 130, (code, err)
    assert seconds < 8, seconds  # steps of 0.3 s: well within the 4 s grace, plus the stop
    said = _said(err, "pstrain: interrupted")
    assert len(said) == 1 and said[0].startswith("pstrain: interrupted"), err
    assert re.search(r"(\d+) step\(s\) in flight finished, (\d+) queued step\(s\) cancelled", said[0])
    assert "latest checkpoint " + str(tmp_path / "ckpt" / "ckpt-1") in said[0], said[0]
    assert "Traceback" not in err and "finished without" not in out, err
    pids = [int(p) for p in next(line for line in lines if line.startswith("pids")).split()[1:]]
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.05)


def test_ctrl_c_on_pstrain_serve_exits_130_with_one_line(tmp_path):
    code, seconds, _, _, err = _interrupt_when(
        [sys.executable, "-m", "pstrain.cli", "serve", "--role", "ps", "--index", "0", "--port", "0"],
        tmp_path,
        "listening on",
    )
    assert code == 130 and seconds < 5, (code, seconds, err)
    said = _said(err, "interrupted (Ctrl-C)")
    assert len(said) == 1 and said[0].startswith("pstrain ps:0: interrupted"), err
    assert "Traceback" not in err


def test_ctrl_c_on_pstrain_launch_reaches_the_program_once_and_exits_130(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    code, seconds, _, out, err = _interrupt_when(
        [
            sys.executable,
            "-m",
            "pstrain.cli",
            "launch",
            "--ps",
            "1",
            "--workers",
            "2",
            "--",
            sys.executable,
            str(script),
            str(tmp_path / "ckpt"),
            "launched",
        ],
        tmp_path,
        "stepping",
    )
    assert code == 130, (code, out, err)
    assert seconds < 10, seconds
    said = _said(out, "pstrain: interrupted (Ctrl-C)")  # the program's line, prefixed [chief]
    assert len(said) == 1 and "in flight finished" in said[0], out + err
    assert "latest checkpoint" in said[0], said[0]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err


def test_ctrl_c_on_pstrain_demo_stops_within_seconds_and_says_what_was_kept(tmp_path):
    checkpoints = tmp_path / "demo" / "checkpoints"
    code, seconds, _, out, err = _interrupt_when(
        [
            sys.executable,
            "-m",
            "pstrain.cli",
            "demo",
            "--steps",
            "100000",
            "--quiet",
            "--checkpoint-every",
            "50",
            "--output",
            str(tmp_path / "demo"),
        ],
        tmp_path,
        "TensorBoard scalars",
        also=lambda: checkpoints.exists() and any(checkpoints.glob("*.index.json")),
    )  # training
    assert code == 130, (code, out, err)
    assert seconds < 10, seconds
    said = _said(err, "pstrain: interrupted")
    assert len(said) == 1 and "in flight finished" in said[0], err
    assert "latest checkpoint" in said[0], said[0]
    assert "Traceback" not in err and "is cancelled" not in err


def test_ctrl_c_with_deltas_running_keeps_every_finished_step_in_a_last_delta(tmp_path):
    """Deltas every 10 minutes: none would be due before the Ctrl-C. The last delta,
    written once the steps in flight finished, holds every step that ran: the counter in
    the checkpoint the line names is the steps scheduled less those cancelled."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("sys.argv[1])", "sys.argv[1], delta_interval_s=600)"))
    code, _, _, out, err = _interrupt_when(
        [sys.executable, str(script), str(tmp_path / "ckpt")], tmp_path, "^stepping"
    )
    assert code == 130, (code, err)
    said = _said(err, "pstrain: interrupted")
    assert len(said) == 1, err
    counts = re.search(r"(\d+) step\(s\) in flight finished, (\d+) queued step\(s\) cancelled", said[0])
    assert counts and "abandoned" not in said[0], said[0]
    kept = re.search(r"latest checkpoint (\S+) \(a last delta, of every step finished\)", said[0])
    assert kept and kept.group(1) == str(tmp_path / "ckpt" / "ckpt-1.delta-1"), said[0]

    value = float(load_variables(kept.group(1))["v"])
    assert value == 401 - int(counts.group(2)), (value, said[0])  # 1 + 400 scheduled
    assert value > 1
