"""LocalCluster and `pstrain launch`: real processes, and none left behind."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import pstrain
from pstrain._base.machine import usable_cores
from pstrain.server.ps.checkpoints.saves import _save_thread
from tests.helpers import TOKEN, ServeProcess, wait_for

pytestmark = pytest.mark.timeout(90)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


SCRIPT = textwrap.dedent("""
    import sys
    import pstrain

    async def main():
        resolver = pstrain.TFConfigClusterResolver()
        assert resolver.task_type == "chief", resolver.task_type
        strategy = pstrain.ParameterServerStrategy(resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0)
        for _ in range(10):
            coordinator.schedule(lambda: v.assign_add(1.0))
        await coordinator.join()
        print("total", await v.numpy())
        from pstrain import rpc
        peers = rpc.ChannelPool(resolver.cluster_spec(), resolver.token)
        pids = []
        for job in ("ps", "worker"):
            for i in range(resolver.cluster_spec().num_tasks(job)):
                pids.append((await peers.channel(job, i).health()).pid)
        print("pids", *pids)
        await coordinator.close()

    pstrain.run(main())
    sys.exit(3)
""")


def test_launch_runs_the_script_and_tears_everything_down(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    result = subprocess.run(
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
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 3, result.stderr
    assert "[chief] total 10.0" in result.stdout
    pids = [int(p) for p in result.stdout.split("pids", 1)[1].split()]
    assert len(pids) == 3
    for pid in pids:
        assert not alive(pid), f"process {pid} outlived pstrain launch"


TIERED = textwrap.dedent("""
    import numpy as np
    import pstrain

    async def main():
        strategy = pstrain.ParameterServerStrategy(pstrain.TFConfigClusterResolver())
        with strategy.scope():
            table = pstrain.DynamicEmbedding(64, name="emb")
            opt = pstrain.optimizers.Adagrad(0.1)
        for k in range(40):  # 40,000 rows of 64 floats and their accumulators: 20 MB
            ids = np.arange(k * 1000, (k + 1) * 1000)
            rows = await table.lookup(ids)
            await opt.apply_gradients([(pstrain.IndexedSlices(np.ones_like(rows), ids), table)])
        stats = await table.statistics()
        print("rows", stats["hot_rows"], stats["cold_rows"])

    pstrain.run(main())
""")


def test_launch_gives_its_ps_a_memory_budget_and_a_table_dir(tmp_path):
    """``pstrain launch --memory-budget --table-dir``: each ps holds the rows past its budget
    on disk under the directory (which it empties when it stops); one without the other is
    refused before anything starts."""
    script = tmp_path / "train.py"
    script.write_text(TIERED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    launch = [sys.executable, "-m", "pstrain.cli", "launch", "--ps", "1", "--workers", "1"]
    tier = tmp_path / "tier"
    result = subprocess.run(
        [*launch, "--memory-budget", "4MiB", "--table-dir", str(tier), "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=80,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    hot, cold = (int(n) for n in result.stdout.split("[chief] rows", 1)[1].split()[:2])
    assert hot + cold == 40_000 and cold > 30_000 and hot > 0, (hot, cold)
    assert tier.is_dir() and not os.listdir(tier)  # each ps removed its own directory
    alone = subprocess.run(
        [*launch, "--memory-budget", "4MiB", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert alone.returncode == 2 and "--memory-budget needs --table-dir" in alone.stderr


def test_launch_needs_a_command():
    result = subprocess.run(
        [sys.executable, "-m", "pstrain.cli", "launch", "--ps", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "needs a command" in result.stderr


async def test_local_cluster_kill_restart_and_teardown_on_error():
    pids = []
    with pytest.raises(ZeroDivisionError):
        async with pstrain.LocalCluster(num_ps=1, num_workers=2) as cluster:
            assert cluster.token and cluster.cluster_spec.num_tasks("worker") == 2
            address = cluster.cluster_spec.task_address("worker", 1)
            pid = cluster.pid("worker", 1)
            await cluster.kill("worker", 1)
            assert cluster.pid("worker", 1) is None and not alive(pid)
            await cluster.restart("worker", 1)
            assert cluster.cluster_spec.task_address("worker", 1) == address
            pids = [cluster.pid(job, i) for job, i in (("ps", 0), ("worker", 0), ("worker", 1))]
            assert all(pids)
            raise ZeroDivisionError("an error inside the block")
    for pid in pids:
        assert not alive(pid)


def test_a_saves_writer_thread_runs_at_the_serving_loops_priority():
    # Not nicer: a niced writer starved behind its own ps's loop on a busy machine, and
    # deltas came later than the SIGKILL guarantee (tests/processes/test_kill_drill.py) allows.

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    for kind in ("full", "delta"):  # a delta has its own: not held up behind a full save
        assert _save_thread(kind).submit(priority).result(timeout=10) == os.getpriority(os.PRIO_PROCESS, 0)
    assert _save_thread("full") is not _save_thread("delta")


async def test_servers_exit_when_their_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent("""
        import asyncio, pstrain
        async def main():
            cluster = await pstrain.LocalCluster(1, 1).start()
            print(cluster.pid("ps", 0), cluster.pid("worker", 0), flush=True)
            await asyncio.sleep(600)
        pstrain.run(main())
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    await wait_for(lambda: not any(alive(p) for p in pids), timeout=15, what="orphans to exit")


WATCHED = textwrap.dedent("""
    import asyncio, pathlib, sys
    import pstrain

    async def main():
        strategy = pstrain.ParameterServerStrategy(pstrain.TFConfigClusterResolver())
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            v = pstrain.Variable(0.0)
        for _ in range(5):
            coordinator.schedule(lambda: v.assign_add(1.0))
        await coordinator.join()
        print("trained", flush=True)
        while not pathlib.Path(sys.argv[1]).exists():  # the test looks at the job meanwhile
            await asyncio.sleep(0.05)
        await coordinator.close()

    pstrain.run(main())
""")


@pytest.mark.timeout(120)
def test_a_launched_job_can_be_watched_with_the_files_it_writes(tmp_path):

    script, done, run_dir = tmp_path / "train.py", tmp_path / "done", tmp_path / "run"
    script.write_text(WATCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pstrain.cli",
            "launch",
            "--ps",
            "1",
            "--workers",
            "2",
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            str(script),
            str(done),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines: list[str] = []
        assert proc.stderr is not None and proc.stdout is not None
        while not any(line.lstrip().startswith("watch with") for line in lines):
            line = proc.stderr.readline()
            assert line, "pstrain launch ended before printing its table: " + "".join(lines)
            lines.append(line)
        table = "".join(lines)
        for task in ("chief:0", "ps:0", "worker:0", "worker:1"):
            assert re.search(rf"^\s+{task}\s+127\.0\.0\.1:\d+", table, re.M), table
        token = run_dir / "token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        config = json.loads((run_dir / "cluster.json").read_text())
        groups = json.loads((run_dir / "targets.json").read_text())
        assert {g["labels"]["role"] for g in groups} == {"chief", "ps", "worker"}
        assert sorted(a for g in groups for a in g["targets"]) == sorted(
            a for addrs in config["cluster"].values() for a in addrs
        )
        while "trained" not in proc.stdout.readline():
            pass
        # what the table says to run, as it is: every task up, the coordinator included
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "pstrain.cli",
                "status",
                "--cluster",
                str(run_dir / "cluster.json"),
                "--token-file",
                str(token),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        assert re.search(r"^chief:0\s+up\s", status.stdout, re.M), status.stdout
        # and what Prometheus scrapes with file_sd_configs + credentials_file: the coordinator too
        import urllib.request

        chief = next(g["targets"][0] for g in groups if g["labels"]["role"] == "chief")
        request = urllib.request.Request(
            f"http://{chief}/metrics", headers={"Authorization": f"Bearer {token.read_text().strip()}"}
        )
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.status == 200 and b"pstrain_" in reply.read()
        done.write_text("")
        assert proc.wait(timeout=60) == 0
        assert not (run_dir / "token").exists() and not (run_dir / "cluster.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _threads() -> tuple[str | None, str | None, int]:
    """What a closure sees of its thread pools (PyTorch loads here, in the closure)."""

    import torch

    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("OPENBLAS_NUM_THREADS"), torch.get_num_threads()


async def _closure_threads(resolver) -> tuple[str | None, str | None, int]:
    strategy = pstrain.ParameterServerStrategy(resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    try:
        return await coordinator.schedule(_threads)
    finally:
        await coordinator.close()


async def test_serve_by_hand_sizes_threads_as_launch_does(tmp_path):

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PSTRAIN_", "TF_CONFIG"))
        and k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS")
    }
    async with pstrain.LocalCluster(num_ps=1, num_workers=1, env=env) as cluster:
        launched = await _closure_threads(cluster.resolver)
    ps = ServeProcess("--role", "ps", "--index", "0", "--port", "0", env=env)
    worker = None
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = {
            "cluster": {"ps": [ps.address], "worker": [f"127.0.0.1:{port}"]},
            "task": {"type": "worker", "index": 0},
        }
        (tmp_path / "cluster.json").write_text(json.dumps(config))
        worker = ServeProcess("--cluster", str(tmp_path / "cluster.json"), "--log-level", "INFO", env=env)
        resolver = pstrain.SimpleClusterResolver(config["cluster"], token=TOKEN)
        by_hand = await _closure_threads(resolver)
        log = worker.stderr()
    finally:
        for server in (worker, ps):
            if server is not None:
                server.stop()
    cores = usable_cores()
    expected = str(max(1, cores // 2))  # one ps and one worker share the cores
    assert launched == by_hand == (expected, expected, int(expected)), (launched, by_hand)
    if cores > 1:
        assert f"OMP_NUM_THREADS={expected}" in log and "2 tasks of the cluster" in log, log


async def test_a_restarted_task_holds_its_port_while_its_new_process_starts():
    """``restart`` binds the task's port again as soon as the task is gone and hands the
    socket to the new process: while that process starts (about a second), no other
    process can bind the port (another cluster's task once did, and the restart failed)."""

    async with pstrain.LocalCluster(num_ps=1, num_workers=1) as cluster:
        address = cluster.cluster_spec.task_address("ps", 0)
        port = int(address.rsplit(":", 1)[1])
        old = cluster.pid("ps", 0)
        await cluster.kill("ps", 0)
        restarting = asyncio.create_task(cluster.restart("ps", 0))
        await wait_for(lambda: cluster.pid("ps", 0) not in (None, old), timeout=30, what="the new process")
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError) as caught:
                other.bind(("127.0.0.1", port))
            assert caught.value.errno == errno.EADDRINUSE
        await asyncio.wait_for(restarting, 60)
        assert cluster.cluster_spec.task_address("ps", 0) == address
        peers = pstrain.rpc.ChannelPool(cluster.cluster_spec, cluster.token)
        try:
            assert (await peers.channel("ps", 0).health()).pid == cluster.pid("ps", 0)
        finally:
            await peers.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.2"])
def test_serve_refuses_a_handed_socket_bound_elsewhere_than_its_host(host):
    """``--listen-fd``: a socket bound to another address than ``--host`` (all interfaces,
    here, for a token-less loopback server) is refused with the address it is bound to."""

    with socket.socket() as bound:
        bound.bind((host, 0))
        port = bound.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PSTRAIN_", "TF_CONFIG"))}
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pstrain.cli",
                "serve",
                "--role",
                "ps",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--listen-fd",
                str(bound.fileno()),
            ],
            pass_fds=(bound.fileno(),),
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
    assert result.returncode != 0 and "listening on" not in result.stdout + result.stderr
    assert f"bound to ('{host}', {port})" in result.stderr, result.stderr


def cores_of(pid: int) -> set[str]:
    """The cores each thread of process ``pid`` may run on (as /proc lists them)."""
    return {
        Path(f"/proc/{pid}/task/{tid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
        for tid in os.listdir(f"/proc/{pid}/task")
    }


async def test_pinned_tasks_run_on_their_share_of_the_cores_and_unpinned_ones_anywhere():
    allowed = sorted(os.sched_getaffinity(0))
    async with pstrain.LocalCluster(num_ps=2, num_workers=2, pin_cpus=True) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        async with strategy.scope():
            v = pstrain.Variable(0.0)

        async def add() -> None:
            await v.assign_add(1.0)

        for _ in range(8):  # the closure threads, started by now, run where their process does
            coordinator.schedule(add)
        await coordinator.join()
        assert float(await v.numpy()) == 8.0
        for k, task in enumerate([("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]):
            if len(allowed) <= 4:  # ps i beside worker i
                want = {str(allowed[k % len(allowed)])}
            else:  # each its own run of cores
                each = len(allowed) // 4
                want = {",".join(map(str, allowed[k * each : (k + 1) * each]))}
            assert cluster.cpus is not None and cluster.cpus[task] == [
                int(c) for c in next(iter(want)).split(",")
            ]
            assert cores_of(cluster.pid(*task)) == want, (task, cores_of(cluster.pid(*task)))
        await coordinator.close()
    async with pstrain.LocalCluster(num_ps=1, num_workers=1) as cluster:
        assert cluster.cpus is None
        anywhere = cores_of(os.getpid())
        assert cores_of(cluster.pid("ps", 0)) == cores_of(cluster.pid("worker", 0)) == anywhere
