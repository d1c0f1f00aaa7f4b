"""LocalCluster and `pstrain launch`: real processes, and none left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import pstrain

from .conftest import wait_for

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
                pids.append((await peers.channel(job, i).call("health", {}))["pid"])
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
        [sys.executable, "-m", "pstrain.cli", "launch", "--ps", "1", "--workers", "2", "--",
         sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 3, result.stderr
    assert "[chief] total 10.0" in result.stdout
    pids = [int(p) for p in result.stdout.split("pids", 1)[1].split()]
    assert len(pids) == 3
    for pid in pids:
        assert not alive(pid), f"process {pid} outlived pstrain launch"


def test_launch_needs_a_command():
    result = subprocess.run([sys.executable, "-m", "pstrain.cli", "launch", "--ps", "1"],
                            capture_output=True, text=True, timeout=30)
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


async def test_servers_exit_when_their_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import asyncio, pstrain
        async def main():
            cluster = await pstrain.LocalCluster(1, 1).start()
            print(cluster.pid("ps", 0), cluster.pid("worker", 0), flush=True)
            await asyncio.sleep(600)
        pstrain.run(main())
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    await wait_for(lambda: not any(alive(p) for p in pids), timeout=15, what="orphans to exit")
