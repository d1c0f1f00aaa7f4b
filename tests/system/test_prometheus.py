"""A real Prometheus (the distribution's package) scrapes a running job with the cluster
token as bearer credentials, and its query API returns pstrain's series."""

from __future__ import annotations

import shutil
import subprocess

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain.cluster import listening_socket
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(120)

SCRAPE = """global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: pstrain
    authorization:
      type: Bearer
      credentials_file: {token_file}
    static_configs:
      - targets: [{targets}]
"""


def prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        raise RuntimeError(
            "this test needs Prometheus (Debian: apt-get install prometheus); `make test` installs it"
        )
    return path


async def test_a_real_prometheus_scrapes_every_task_with_the_token(tmp_path):
    tiered = {"memory_budget": "2MiB", "table_dir": tmp_path / "tier"}
    async with pstrain.LocalCluster(num_ps=1, num_workers=1, **tiered) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        chief = await coordinator.serve_metrics()
        async with strategy.scope():
            v = pstrain.Variable(np.zeros(4), name="v")
            table = pstrain.DynamicEmbedding(16, name="emb")
        for _ in range(10):
            coordinator.schedule(lambda: v.assign_add(np.ones(4)))
        await coordinator.join()
        for k in range(8):  # past the ps's budget: rows on disk, and some read back
            await table.lookup(np.arange(1000 * k, 1000 * k + 1000))
        await table.lookup(np.arange(0, 1000))
        stats = await table.statistics()
        assert stats["cold_rows"] > 0 and stats["promoted"] > 0, stats
        token_file = tmp_path / "token"
        token_file.write_text(cluster.token)
        token_file.chmod(0o600)
        targets = [
            cluster.cluster_spec.task_address("ps", 0),
            cluster.cluster_spec.task_address("worker", 0),
            chief,
        ]
        config = tmp_path / "prometheus.yml"
        config.write_text(SCRAPE.format(token_file=token_file, targets=", ".join(targets)))
        port_sock = listening_socket("127.0.0.1", 0, "prometheus")
        port = port_sock.getsockname()[1]
        port_sock.close()
        proc = subprocess.Popen(
            [
                prometheus(),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            api = f"http://127.0.0.1:{port}/api/v1/query"
            async with aiohttp.ClientSession() as session:

                async def query(q):
                    try:
                        async with session.get(api, params={"query": q}) as r:
                            body = await r.json()
                            return body["data"]["result"] if body.get("status") == "success" else []
                    except aiohttp.ClientError:
                        return []

                async def all_up():  # Prometheus starts, then scrapes every second
                    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                    up = await query("up")
                    return len(up) == 3 and all(r["value"][1] == "1" for r in up)

                await wait_for(all_up, timeout=60, what="every target scraped and up")
                uptime = await query("pstrain_uptime_seconds")
                assert {(r["metric"]["role"], r["metric"]["task"]) for r in uptime} == {
                    ("ps", "0"),
                    ("worker", "0"),
                    ("chief", "0"),
                }
                updates = await query('sum(pstrain_requests_total{role="ps",op="vars/assign_add"})')
                assert float(updates[0]["value"][1]) == 10
                assert await query('pstrain_closures_done_total{role="chief"}')
                assert await query('pstrain_variable_bytes{role="ps"}')
                # the counters the operations guide computes a tiered table's hit rate from
                looked = await query('sum(pstrain_table_looked_up_total{role="ps"})')
                promoted = await query('sum(pstrain_table_promoted_total{role="ps"})')
                assert float(looked[0]["value"][1]) == stats["looked_up"]
                assert float(promoted[0]["value"][1]) == stats["promoted"]
        finally:
            proc.terminate()  # only the process this test started, by its PID
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            proc.stderr.close()
        await coordinator.close()
