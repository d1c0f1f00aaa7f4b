"""The dashboard in a real headless Chromium."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import pstrain
from pstrain._kernels import KERNELS
from pstrain.server import ParameterServer
from pstrain.testing import InProcessCluster

pytestmark = pytest.mark.timeout(120)


STEPS = 40


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError(
            "the dashboard tests need Chromium (Debian: apt-get install chromium); `make test` installs it"
        )
    return path


@pytest.fixture(autouse=True)
def _chromium_first() -> None:
    """Every test here drives Chromium: without it, fail before a test starts a cluster or
    a server it would leave open (an open listener keeps the test loop from closing)."""
    chromium()


@contextlib.asynccontextmanager
async def logged_in(url: str) -> AsyncIterator[Any]:
    """A Chromium page that has opened the one-time login URL ``url``."""
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            page.set_default_timeout(15_000)
            assert (await page.goto(url)).status == 200
            yield page
        finally:
            await browser.close()


@contextlib.asynccontextmanager
async def dashboard_page(coordinator: Any) -> AsyncIterator[Any]:
    """A Chromium page logged in to ``coordinator``'s dashboard; the coordinator (and its
    dashboard) closed on the way out, the test failed or not."""
    try:
        url = await pstrain.dashboard.serve_dashboard(coordinator)
        async with logged_in(url) as page:
            yield page
    finally:
        await coordinator.close()


async def test_the_dashboard_in_a_real_browser(tmp_path):
    from playwright.async_api import async_playwright

    pstrain.summary.LOG.clear()
    async with pstrain.LocalCluster(num_ps=1, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with pstrain.ClusterCoordinator(strategy) as coordinator:
            async with strategy.scope():
                v = pstrain.Variable(0.0, name="v")

            async def step(i):
                await v.assign_add(1.0)
                pstrain.summary.scalar("loss", 1.0 / (i + 1), step=i)  # from the closure
                return i

            for i in range(STEPS):
                coordinator.schedule(step, args=(i,))
            await coordinator.join()
            url = await pstrain.dashboard.serve_dashboard(coordinator)
            base = url.split("/login")[0]
            async with async_playwright() as p:
                browser = await p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
                try:
                    page = await browser.new_page()
                    refused = await page.goto(base + "/")
                    assert refused.status == 401 and "not logged in" in await page.content()
                    page.set_default_timeout(15_000)
                    assert (await page.goto(url)).status == 200
                    for task in ("chief:0", "ps:0", "worker:0", "worker:1"):
                        await page.wait_for_selector(f'[data-task="{task}"][data-state="up"]')
                    await page.wait_for_selector(f'[data-scalar="loss"][data-points="{STEPS}"]')
                    assert await page.locator("canvas").count() >= 6  # uPlot drew the charts
                    # The one-time URL is spent: a second browser cannot use it.
                    other = await browser.new_page()
                    assert (await other.goto(url)).status == 401

                    killed = time.monotonic()
                    await cluster.kill("worker", 1)
                    await page.wait_for_selector('[data-task="worker:1"][data-state="down"]', timeout=5_000)
                    assert time.monotonic() - killed < 5
                    await cluster.restart("worker", 1)
                    await page.wait_for_selector('[data-task="worker:1"][data-state="up"]', timeout=30_000)
                    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
                finally:
                    await browser.close()
            served = pstrain.dashboard.of(coordinator)
            assert served is not None and served.snapshots > 0


async def test_markup_in_every_field_the_dashboard_shows_is_text(tmp_path):
    """A checkpoint path, a task's address, a scalar's name: whatever a job puts there is shown
    as text in Chromium, never run; an address with markup is refused where it enters."""

    payload = "<img src=x onerror=window.__pwned=1>"
    root = tmp_path / payload
    root.mkdir()
    pstrain.summary.LOG.clear()
    async with InProcessCluster(
        num_ps=1, num_workers=1, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        async with strategy.scope():
            v = pstrain.Variable(0.0, name="v")
        await pstrain.Checkpoint(v=v).write(str(root / "ckpt"))
        pstrain.summary.scalar(payload, 1.0, step=0)
        with pytest.raises(pstrain.errors.InvalidArgumentError, match="host name"):
            await coordinator.admit_worker(payload + ":80")
        coordinator.schedule(lambda: None)
        await coordinator.join()
        async with dashboard_page(coordinator) as page:
            await page.wait_for_selector('[data-task="worker:0"][data-state="up"]')
            cell = page.locator("#checkpoints td", has_text=payload)
            await cell.first.wait_for()
            assert payload in await cell.first.text_content()
            assert await page.locator("#checkpoints img").count() == 0
            assert await page.evaluate("window.__pwned") is None
            assert await page.locator("img").count() == 0  # no markup became an element


async def test_the_dashboard_shows_the_tables_a_smoothed_loss_and_a_finished_job():

    pstrain.summary.LOG.clear()
    raw = [1.0 + (0.5 if i % 2 else -0.5) / (1 + i / 10) for i in range(30)]  # noisy, falling
    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            users = pstrain.DynamicEmbedding(4, name="users", capacity=6)  # 3 rows per ps
        await users.lookup(np.arange(40, dtype=np.int64))  # admits up to the capacity, evicts
        stats = await users.statistics()
        for step, value in enumerate(raw):
            pstrain.summary.scalar("loss", value, step=step)
        coordinator.schedule(lambda: None)
        await coordinator.join()
        async with dashboard_page(coordinator) as page:
            row = page.locator(f'#tables tr[data-table="users"][data-rows="{stats["rows"]}"]')
            await row.wait_for()
            cells = [await c.text_content() for c in await row.locator("td").all()]
            assert cells[:3] == ["users", str(stats["rows"]), "6"], cells
            assert not await page.locator("#no-tables").is_visible()
            for k in (0, 1):  # each ps box says what its table rows take
                box = page.locator(f'[data-task="ps:{k}"]')
                await box.locator("text=/MiB in tables/").wait_for()
            chart = page.locator(f'[data-scalar="loss"][data-points="{len(raw)}"]')
            await chart.wait_for()
            smoothed = raw[0]
            for y in raw[1:]:
                smoothed = 0.6 * smoothed + 0.4 * y
            shown = float(await chart.get_attribute("data-smoothed"))
            assert abs(shown - smoothed) < 1e-9 and abs(shown - raw[-1]) > 0.05
            await page.wait_for_selector('[data-task="worker:0"][data-state="up"]')
            await coordinator.close()  # the job ends: the page says so, nothing stays "up"
            await page.wait_for_selector('body[data-finished="true"]')
            states = await page.locator(".task").evaluate_all("els => els.map(e => e.dataset.state)")
            assert states and set(states) == {"finished"}, states
            assert "finished" in await page.locator("#status").text_content()


async def test_the_dashboard_draws_the_placement_map_as_a_ps_joins_and_leaves():

    async with InProcessCluster(num_ps=2, num_workers=1) as cluster:
        extra = ParameterServer(2, token=cluster.token)
        await extra.start()
        try:
            strategy = pstrain.ParameterServerStrategy(
                pstrain.SimpleClusterResolver(cluster.cluster_spec, token=cluster.token)
            )
            coordinator = pstrain.ClusterCoordinator(strategy)
            async with strategy.scope():
                for k in range(4):
                    pstrain.Variable(np.zeros(1 << 18, np.float32), name=f"v{k}")  # 1 MiB each
                table = pstrain.DynamicEmbedding(4, name="users")
            await table.lookup(np.arange(1000))
            async with dashboard_page(coordinator) as page:
                await page.wait_for_selector('#placement tr[data-ps="1"]')
                assert "map version 0" in await page.text_content("#placement-status")
                await coordinator.add_ps(extra.address)
                row = page.locator('#placement tr[data-ps="2"]')
                await row.wait_for()
                await page.wait_for_function(  # a 1 MiB variable, and its share of the table's rows
                    r"/[1-9]\.\d MiB/.test("
                    "document.querySelector('#placement tr[data-ps=\"2\"]').textContent)"
                )
                assert "yes" in await row.text_content()
                await page.wait_for_function(  # 42 of the table's 128 slices
                    "document.querySelector('#placement tr[data-ps=\"2\"]').textContent"
                    ".includes('users 32.8%')"
                )
                await page.wait_for_function(
                    r"/\b[1-9]\d* move\(s\) done/"
                    ".test(document.getElementById('placement-status').textContent)"
                )
                await coordinator.remove_ps(2)
                await page.wait_for_selector('[data-task="ps:2"][data-state="left"]')
                await page.wait_for_function(
                    "document.querySelector('#placement tr[data-ps=\"2\"]').textContent.includes('left')"
                )
                assert "0.0 MiB" in await row.text_content()
        finally:
            await extra.stop()


async def test_the_dashboard_shows_a_tiered_tables_rows_on_disk(tmp_path):
    options = {"memory_budget": 1 << 20, "table_dir": str(tmp_path / "tier")}
    async with InProcessCluster(num_ps=2, num_workers=1, ps_options=options) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        with strategy.scope():
            users = pstrain.DynamicEmbedding(16, name="users")
            sgd = pstrain.optimizers.SGD(0.1)
        for k in range(10):
            ids = np.arange(1000 * k, 1000 * k + 1000, dtype=np.int64)
            await users.lookup(ids)
            if k == 0:  # trained: read back from disk later (rows as made are made again)
                grad = pstrain.IndexedSlices(np.ones((1000, 16), np.float32), ids)
                await sgd.apply_gradients([(grad, users)])
        await users.lookup(np.arange(0, 500, dtype=np.int64))  # some back from disk
        stats = await users.statistics()
        assert stats["cold_rows"] > 0 and stats["cold_rows_read"] > 0, stats
        async with dashboard_page(coordinator) as page:
            row = page.locator(f'#tables tr[data-table="users"][data-cold="{stats["cold_rows"]}"]')
            await row.wait_for()
            cells = [await c.text_content() for c in await row.locator("td").all()]
            assert cells[6].startswith(f"{stats['cold_rows']:,} ("), cells
            hit = 100 * (1 - stats["promoted"] / stats["looked_up"])
            assert cells[7] == f"{hit:.1f}", cells  # nothing looked up since: since the start
            cached = 100 * stats["cold_rows_from_page_cache"] / stats["cold_rows_read"]
            assert cells[11] == f"{cached:.1f}", cells  # (rows just written: in the page cache)
            # The hit rate is what the hot set does now: three lookups of rows long moved to
            # disk show the few found in RAM between two snapshots, not the share since the
            # start (still over 80 %), and the share since the start again once no lookup
            # comes between snapshots.
            for k in range(1, 4):
                await users.lookup(np.arange(1000 + 500 * k, 1500 + 500 * k, dtype=np.int64))
            after = await users.statistics()
            assert 1 - after["promoted"] / after["looked_up"] > 0.8, after
            assert after["promoted"] - stats["promoted"] > 0.6 * 1500, after
            cell = "document.querySelector('#tables tr[data-table=\"users\"]').querySelectorAll('td')[7]"
            await page.wait_for_function(f"Number({cell}.textContent) < 40")
            since_start = f"{100 * (1 - after['promoted'] / after['looked_up']):.1f}"
            await page.wait_for_function(f"{cell}.textContent === '{since_start}'")
            assert cells[10] == ("io_uring" if KERNELS.io_uring_reads() else "pread"), (
                cells
            )  # as the ps reads
