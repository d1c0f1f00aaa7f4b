"""Running pstrain: /metrics on every server, `pstrain status`, SLURM and TFJob configs, the demo."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pstrain
from pstrain._base.cluster import reserved_port
from pstrain.cluster import SlurmClusterResolver
from tests.helpers import TOKEN, ServeProcess

pytestmark = pytest.mark.timeout(120)


async def scrape(address: str, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{address}/metrics", headers=headers) as resp:
            return resp.status, await resp.text()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(parsed: dict, name: str) -> float:
    return sum(v for (n, _), v in parsed.items() if n == name)


async def test_metrics_on_ps_worker_and_coordinator_move_during_training(cluster):
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    chief = await coordinator.serve_metrics()
    async with strategy.scope():
        v = pstrain.Variable(0.0, name="v")
    addresses = {
        "ps": cluster.cluster_spec.task_address("ps", 0),
        "worker": cluster.cluster_spec.task_address("worker", 0),
        "chief": chief,
    }
    for address in addresses.values():
        assert (await scrape(address, None))[0] == 401
        assert (await scrape(address, "wrong"))[0] == 401
    before = {k: samples((await scrape(a, cluster.token))[1]) for k, a in addresses.items()}
    for _ in range(40):
        coordinator.schedule(lambda: v.assign_add(1.0))
    await coordinator.join()
    after = {k: samples((await scrape(a, cluster.token))[1]) for k, a in addresses.items()}
    assert total(after["ps"], "pstrain_requests_total") > total(before["ps"], "pstrain_requests_total")
    assert total(after["ps"], "pstrain_variables") >= 1 and total(after["ps"], "pstrain_variable_bytes") >= 4
    assert "pstrain_request_seconds_count" in {n for n, _ in after["ps"]}
    ran = total(after["worker"], "pstrain_closures_run_total")
    assert ran > total(before["worker"], "pstrain_closures_run_total")
    assert total(after["chief"], "pstrain_closures_done_total") >= 40
    assert total(after["chief"], "pstrain_queued") == 0
    await coordinator.close()


async def test_metrics_public_flag():
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--metrics-public")
    try:
        status, text = await scrape(server.address, None)
        assert status == 200 and "pstrain_uptime_seconds" in text
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{server.address}/healthz") as resp:
                assert resp.status == 401  # only /metrics is opened
    finally:
        server.stop()


async def test_status_shows_a_killed_worker_as_down_quickly(process_cluster, tmp_path):
    cluster = process_cluster
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster.config()))
    env = dict(os.environ, PSTRAIN_TOKEN=cluster.token)
    await cluster.kill("worker", 1)
    # its port held, bound and not listening (as a down task's is refused): another test's
    # server took the freed port once, and status rightly said "mismatch" there
    port = int(cluster.cluster_spec.task_address("worker", 1).rsplit(":", 1)[1])
    with reserved_port("127.0.0.1", port, "worker:1"):
        # what starting the command costs on this machine now (its imports: seconds when the
        # machine is loaded), measured beside it: a dead worker must cost less than 5 s more
        t = time.monotonic()
        started = subprocess.run(
            [sys.executable, "-m", "pstrain.cli", "status", "--help"],
            capture_output=True,
            timeout=30,
            env=env,
        )
        start_s = time.monotonic() - t
        assert started.returncode == 0
        t = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "pstrain.cli", "status", "--cluster", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
        )
        assert time.monotonic() - t < 5 + start_s
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert " down " in lines["worker:1"] and " up " in lines["worker:0"]
    assert " up " in lines["ps:0"] and "variables" in lines["ps:0"]
    assert result.returncode == 1  # not every task is up


def test_slurm_resolver_with_the_environment_srun_sets():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_STEP_NODELIST": "node[001-003],gpu7",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "PSTRAIN_TOKEN": "t",
    }
    r = SlurmClusterResolver(jobs={"chief": 1, "ps": 2, "worker": 4}, port_base=8888, environ=env)
    assert r.cluster_spec().as_dict() == {
        "chief": ["gpu7:8888"],
        "ps": ["node001:8888", "node001:8889"],
        "worker": ["node002:8888", "node002:8889", "node003:8888", "node003:8889"],
    }
    assert (r.task_type, r.task_id, r.token) == ("worker", 0, "t")
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="more tasks than assigned"):
        SlurmClusterResolver(jobs={"ps": 4, "worker": 4}, environ=env)
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="SLURM_PROCID"):
        SlurmClusterResolver(jobs={"ps": 1}, environ={})


def test_slurm_node_names_that_do_not_sort_as_strings_keep_slurms_rank_order():
    env = {
        "SLURM_PROCID": "2",
        "SLURM_STEP_NUM_TASKS": "3",
        "SLURM_STEP_NODELIST": "n[8-10]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
        "SLURMD_NODENAME": "n10",
        "PSTRAIN_TOKEN": "t",
    }
    r = SlurmClusterResolver(jobs={"chief": 1, "ps": 1, "worker": 1}, port_base=8888, environ=env)
    assert r.cluster_spec().as_dict() == {"chief": ["n8:8888"], "ps": ["n9:8888"], "worker": ["n10:8888"]}
    assert (r.task_type, r.task_id) == ("worker", 0)  # rank 2 runs on n10, as SLURM placed it
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="rank 2 on n8.*distribution=block"):
        SlurmClusterResolver(
            jobs={"chief": 1, "ps": 1, "worker": 1}, environ={**env, "SLURMD_NODENAME": "n8"}
        )


def test_tfjob_tf_config_as_the_operator_injects_it(monkeypatch):
    tf_config = {
        "cluster": {
            "chief": ["mnist-chief-0.kubeflow.svc:2222"],
            "ps": ["mnist-ps-0.kubeflow.svc:2222"],
            "worker": ["mnist-worker-0.kubeflow.svc:2222", "mnist-worker-1.kubeflow.svc:2222"],
        },
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    r = pstrain.TFConfigClusterResolver()
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert r.cluster_spec().task_address("ps", 0) == "mnist-ps-0.kubeflow.svc:2222"


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, IndexError, ValueError):
                pass
    return out


def test_demo_stops_cleanly_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pstrain.cli",
            "demo",
            "--steps",
            "100000",
            "--checkpoint-every",
            "50",
            "--output",
            str(tmp_path),
            "--quiet",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _interrupt_demo(proc, tmp_path)
    finally:
        if proc.poll() is None:  # the test failed half-way: do not leave a training job behind
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _interrupt_demo(proc, tmp_path):
    assert "starting" in proc.stdout.readline()
    assert "cluster up" in proc.stdout.readline()
    servers = children(proc.pid)
    assert len(servers) == 4
    deadline = time.monotonic() + 60
    checkpoints = tmp_path / "checkpoints"
    while not (checkpoints.exists() and any(p.endswith(".index.json") for p in os.listdir(checkpoints))):
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err  # interrupted, as Python's own Ctrl-C exit
    assert time.monotonic() - t0 < 10
    manager = pstrain.checkpoint.CheckpointManager(None, str(checkpoints))
    said = [line for line in err.splitlines() if line.startswith("pstrain: interrupted (Ctrl-C)")]
    assert len(said) == 1 and f"latest checkpoint {manager.latest_checkpoint}" in said[0], err
    assert "model/table" in pstrain.checkpoint.load_variables(manager.latest_checkpoint)
    deadline = time.monotonic() + 15  # stopped by the demo; reaped by init once it is gone
    while any(_running(pid) for pid in servers):
        assert time.monotonic() < deadline, [pid for pid in servers if _running(pid)]
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_serve_takes_its_role_from_slurm():

    with socket.socket() as s:  # a base port for the SLURM layout (the server binds it itself)
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    env = dict(
        os.environ,
        SLURM_PROCID="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NODELIST="127.0.0.1",
        SLURM_STEP_TASKS_PER_NODE="2",
    )
    server = ServeProcess(
        "--slurm-jobs", "ps=1,worker=1", "--port-base", str(base - 1), "--host", "127.0.0.1", env=env
    )
    try:
        assert server.address == f"127.0.0.1:{base}"  # rank 1 = worker 0, the node's second port
        channel = pstrain.rpc.Channel(server.address, token=TOKEN, task="w")
        health = await channel.health()
        await channel.close()
        assert (health.role, health.index) == ("worker", 0)
    finally:
        server.stop()


async def test_coordinator_serves_metrics_at_its_chief_address(cluster):

    with socket.socket() as s:  # the chief's port as a TF_CONFIG would name it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = dict(cluster.cluster_spec.as_dict(), chief=[f"127.0.0.1:{port}"])
    resolver = pstrain.SimpleClusterResolver(spec, task_type="chief", task_id=0, token=cluster.token)
    coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(resolver))
    try:
        assert await coordinator.schedule(lambda: 1) == 1

        async def scraped():
            try:
                return (await scrape(f"127.0.0.1:{port}", cluster.token))[0] == 200
            except aiohttp.ClientError:
                return False

        from tests.helpers import wait_for

        await wait_for(scraped, what="the coordinator's /metrics")
        status, text = await scrape(f"127.0.0.1:{port}", cluster.token)
        assert total(samples(text), "pstrain_closures_done_total") == 1
    finally:
        await coordinator.close()
