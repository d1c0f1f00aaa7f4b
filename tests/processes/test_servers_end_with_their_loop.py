"""A server its program never stopped stops when the event loop it serves on ends.

A TF program never closes its ClusterCoordinator, and a test that fails never reaches the
line that would. Whatever pstrain serves on that loop (an in-process ps, a coordinator's
dashboard) must then neither stay listening nor hold the loop's close: uvloop warns of a
server left open from inside ``loop.close()``, and where warnings are errors (pytest's
``filterwarnings = error``, as this project runs its tests) that close then waits for good,
past any timeout pytest sets. Each case runs in a process of its own, given a deadline, so
that a hang fails the test instead of the run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

DEADLINE_S = 60

PROGRAM = textwrap.dedent(
    """
    import asyncio
    import socket

    import pstrain
    from pstrain._serving.core import Status
    from pstrain._transport.bridge import new_event_loop
    from pstrain.server import ParameterServer
    from pstrain.testing import InProcessCluster

    left = []

    async def main():
        ps = ParameterServer(0)
        await ps.start()
        async with InProcessCluster(num_ps=1, num_workers=1) as cluster:
            strategy = pstrain.ParameterServerStrategy(cluster.resolver)
            coordinator = pstrain.ClusterCoordinator(strategy)  # never closed
            await pstrain.dashboard.serve_dashboard(coordinator)
            left.extend([ps, pstrain.dashboard.of(coordinator)])

    def runner(main):  # asyncio.run on uvloop, as pytest-asyncio runs a test
        with asyncio.Runner(loop_factory=new_event_loop) as r:
            r.run(main)

    for run in (pstrain.run, runner):
        left.clear()
        run(main())
        for server in left:
            host, port = server.address.rsplit(":", 1)
            with socket.socket() as s:
                refused = s.connect_ex((host, int(port))) != 0
            print(server.status.value, "refused" if refused else "accepted", flush=True)
    """
)

TESTS = textwrap.dedent(
    """
    import pstrain
    from pstrain.testing import InProcessCluster


    async def served():
        cluster = await InProcessCluster(num_ps=1, num_workers=1).start()
        coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
        url = await pstrain.dashboard.serve_dashboard(coordinator)
        await cluster.close()
        return url


    async def test_passes_with_its_dashboard_open():
        assert await served()


    async def test_fails_with_its_dashboard_open():
        assert not await served()
    """
)

CONFTEST = textwrap.dedent(
    """
    def pytest_asyncio_loop_factories(config, item):
        import uvloop

        return {"uvloop": uvloop.new_event_loop}
    """
)

INI = textwrap.dedent(
    """
    [pytest]
    asyncio_mode = auto
    asyncio_default_fixture_loop_scope = function
    filterwarnings = error
    """
)


def run(args: list[str], cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=DEADLINE_S, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"still running after {DEADLINE_S} s (its loop's close waits for good): {exc.stdout!r}")


def test_a_ps_and_a_dashboard_left_serving_stop_with_their_loop():
    done = run([sys.executable, "-c", PROGRAM])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:-1] == ["closed refused"] * 4, done.stdout


def test_a_pytest_run_ends_when_its_tests_leave_a_dashboard_serving(tmp_path):
    (tmp_path / "test_open.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(INI)
    done = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout", str(tmp_path)],
        cwd=str(tmp_path),
    )
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-3000:]
