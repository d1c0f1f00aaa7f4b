"""Configuration errors that only real processes show: TLS mismatches, ``pstrain status`` on refused tasks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

import pstrain
from pstrain.errors import (
    AuthenticationError,
    ProtocolError,
)
from pstrain.server.config import client_ssl
from tests.helpers import TOKEN, ServeProcess, join_fails, self_signed_cert

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


async def test_tls_mismatch_both_ways_is_permanent(tls_files, caplog):
    cert, key = tls_files
    tls_worker = ServeProcess(
        "--role", "worker", "--index", "0", "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key)
    )
    plain_worker = ServeProcess("--role", "worker", "--index", "0", "--port", "0")
    try:
        ps = "127.0.0.1:9"  # never reached: only the workers matter here
        plain = pstrain.ParameterServerStrategy(
            pstrain.SimpleClusterResolver({"ps": [ps], "worker": [tls_worker.address]}, token=TOKEN)
        )
        coordinator = pstrain.ClusterCoordinator(plain)
        err = await join_fails(coordinator, ProtocolError, "expects TLS")
        assert err.task == "/job:worker/replica:0/task:0"
        await coordinator.close()

        resolver = pstrain.SimpleClusterResolver({"ps": [ps], "worker": [plain_worker.address]}, token=TOKEN)
        resolver.ssl_context = client_ssl(str(cert))
        coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(resolver))
        await join_fails(coordinator, AuthenticationError, "TLS handshake .* failed")
        await coordinator.close()
        retries = [r for r in caplog.records if "not retried" in r.getMessage()]
        assert len(retries) == 2  # one report per coordinator, then no retry loop
    finally:
        tls_worker.stop()
        plain_worker.stop()


async def test_pstrain_status_names_refused_and_mismatched_tasks(cluster, tmp_path):
    spec = cluster.cluster_spec
    config = tmp_path / "cluster.json"
    config.write_text(
        json.dumps({"cluster": {"ps": spec.job_tasks("ps"), "worker": spec.job_tasks("worker")[::-1]}})
    )
    token = tmp_path / "token"
    token.write_text(cluster.token)

    def status(token_file):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pstrain",
                "status",
                "--cluster",
                str(config),
                "--token-file",
                str(token_file),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    result = await asyncio.get_running_loop().run_in_executor(None, status, token)
    assert result.returncode == 1
    assert "mismatch" in result.stdout and "is /job:worker/replica:0/task:1, not" in result.stdout
    bad = tmp_path / "bad"
    bad.write_text("not-the-token")
    result = await asyncio.get_running_loop().run_in_executor(None, status, bad)
    assert result.returncode == 1 and "refused" in result.stdout
    assert "AuthenticationError" in result.stdout and "PSTRAIN_TOKEN" in result.stdout
