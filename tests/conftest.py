"""Shared fixtures: real servers on 127.0.0.1, in this process or as processes; a clean
environment; the tiers.

Tests sit in four tiers, one folder each (``tests/README.md``): ``unit`` (no process, no
socket), ``cluster`` (servers in the test's own loop, :class:`pstrain.testing.InProcessCluster`,
with a leak check at teardown), ``processes`` (real processes: kills, restarts, signals,
the CLI; ``process_cluster`` or :class:`tests.helpers.ServeProcess`) and ``system``
(SLURM, Chromium, Prometheus, network namespaces, the wheel). Each test is marked with its
tier, and a test of the first two tiers that starts what its tier rules out fails, naming
the tier it belongs in. The doctests of ``pstrain/`` are unit tests.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

import pstrain
from pstrain.testing import InProcessCluster

from .helpers import TOKEN, Drill, ServeProcess

# aiohttp builds two TLS client contexts as it is imported, each reading the system's CA
# bundle: 0.08 s of CPU in each of the ~300 processes a test run starts (servers, the CLI).
# No test checks a certificate against the system's CAs (pstrain's TLS is checked against
# the CA each test makes), so the processes a test run starts read none.
os.environ.setdefault("SSL_CERT_FILE", os.devnull)
os.environ.setdefault("SSL_CERT_DIR", os.devnull)


TIERS = ("unit", "cluster", "processes", "system")
HERE = Path(__file__).resolve().parent


def tier_of(path: Path) -> str | None:
    """The tier of a test file: its folder under ``tests/`` (a doctest of pstrain/: unit;
    a file outside the tier folders, brought in from elsewhere: none, and no rules)."""
    try:
        folder = Path(path).resolve().relative_to(HERE).parts[0]
    except ValueError:
        return "unit"
    return folder if folder in TIERS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


class TierError(AssertionError):
    """A test did what its tier rules out."""


def _refuse(what: str, tier: str, belongs: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise TierError(f"a test in tests/{tier}/ {what}: it belongs in tests/{belongs}/")

    return refused


@pytest.fixture(autouse=True)
def tier_rules(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``unit`` tests start no process and open no network socket; ``cluster`` tests start no
    process. Checked where processes and sockets start, so a test in the wrong tier fails."""
    tier = tier_of(request.node.path)
    if tier not in ("unit", "cluster"):
        return
    spawn = _refuse("started a process", tier, "processes")
    monkeypatch.setattr(subprocess.Popen, "__init__", spawn)
    monkeypatch.setattr(os, "fork", spawn)
    monkeypatch.setattr(asyncio, "create_subprocess_exec", spawn)
    monkeypatch.setattr(asyncio, "create_subprocess_shell", spawn)
    if tier == "unit":
        for method in ("bind", "connect", "listen"):
            original = getattr(socket.socket, method)
            monkeypatch.setattr(socket.socket, method, _network_only(original, method))


def _network_only(original: Any, method: str) -> Any:
    refused = _refuse(f"called socket.{method} on a network socket", "unit", "cluster")

    def guarded(self: socket.socket, *args: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            self.close()  # refused, not left for the collector to warn of in a later test
            return refused()
        return original(self, *args)

    return guarded


@pytest_asyncio.fixture(autouse=True)
async def close_channels() -> AsyncIterator[None]:
    """Connections a test opened are closed on its loop (as pstrain.run does)."""
    yield
    from pstrain.rpc import close_loop_channels

    await close_loop_channels()


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees the developer's cluster configuration."""
    for key in list(os.environ):
        if key == "TF_CONFIG" or key.startswith("PSTRAIN_"):
            monkeypatch.delenv(key)


def pytest_asyncio_loop_factories(config, item):
    """Async tests run on uvloop, the runtime's own loop."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def ps_process(drill: Drill) -> ServeProcess:
    """One `pstrain serve --role ps` process with the test token."""
    return drill.serve("--role", "ps", "--index", "0", "--port", "0", "--checkpoint-root", "/tmp")


@pytest_asyncio.fixture
async def ps_server(tmp_path: Any) -> AsyncIterator[Any]:
    """One in-process ps with the test token; checkpoints go under ``tmp_path``."""
    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as c:
        yield c.ps[0]


@pytest_asyncio.fixture
async def ps_pair(tmp_path: Any) -> AsyncIterator[list[Any]]:
    """Two in-process ps with the test token; checkpoints go under ``tmp_path``."""
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as c:
        yield c.ps


@pytest_asyncio.fixture
async def cluster(tmp_path: Any) -> AsyncIterator[InProcessCluster]:
    """2 ps + 2 workers as servers in this process, checked for leaks at teardown."""
    async with InProcessCluster(num_ps=2, num_workers=2, ps_options={"checkpoint_root": str(tmp_path)}) as c:
        yield c


@pytest_asyncio.fixture
async def drill() -> AsyncIterator[Drill]:
    """The fault drills' one fixture: clusters, ``pstrain serve`` processes and jobs the
    test starts through it are stopped when it ends (:class:`tests.helpers.Drill`)."""
    started = Drill()
    try:
        yield started
    finally:
        await started.close()


@pytest_asyncio.fixture
async def process_cluster(drill: Drill) -> pstrain.LocalCluster:
    """2 ps + 2 workers as real processes (for kills, restarts and signals)."""
    return await drill.cluster(num_ps=2, num_workers=2)
