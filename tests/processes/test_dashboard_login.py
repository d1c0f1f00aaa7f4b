"""A running job's dashboard login, renewed from the command line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

import pstrain
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(120)


async def test_a_new_login_url_comes_from_the_cli_for_a_running_job(tmp_path):
    """The one-time URL the coordinator printed is spent (a browser that hung opened it):
    ``pstrain dashboard-login`` gets a new one with the cluster's token; a wrong token gets
    nothing; the 401 page names that command."""

    async with pstrain.testing.InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as c:
        coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(c.resolver))
        try:
            await _login_again(coordinator, TOKEN)
        finally:
            await coordinator.close()


async def _login_again(coordinator: Any, token: str) -> None:

    spent = await pstrain.dashboard.serve_dashboard(coordinator)
    served = pstrain.dashboard.of(coordinator)
    assert served is not None and served.address is not None
    async with aiohttp.ClientSession() as session:
        async with session.get(spent, allow_redirects=False) as r:
            assert r.status == 302  # a browser used it up
        async with session.get(spent, allow_redirects=False) as r:
            assert r.status == 401 and f"pstrain dashboard-login {served.address}" in await r.text()

    def cli(with_token: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PSTRAIN_")}
        env["PSTRAIN_TOKEN"] = with_token
        return subprocess.run(
            [sys.executable, "-m", "pstrain.cli", "dashboard-login", served.address],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    wrong, right = await asyncio.gather(
        asyncio.to_thread(cli, "not-the-token"), asyncio.to_thread(cli, token)
    )
    assert wrong.returncode == 2 and "refused the token" in wrong.stderr and not wrong.stdout
    assert right.returncode == 0, right.stderr
    fresh = right.stdout.strip()
    assert fresh.startswith(f"http://{served.address}/login?key=") and fresh != spent
    jar = aiohttp.CookieJar(unsafe=True)  # a cookie of 127.0.0.1, as a browser keeps it
    async with aiohttp.ClientSession(cookie_jar=jar) as session:  # a new browser logs in with it
        async with session.get(fresh) as r:
            assert r.status == 200 and "pstrain" in await r.text()
