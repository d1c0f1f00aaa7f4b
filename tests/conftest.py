"""Shared fixtures: real servers on 127.0.0.1, in this process or as processes; a clean environment.

Most tests run against :class:`pstrain.testing.InProcessCluster` (servers in
the test's own loop, with a leak check at teardown). Tests about processes
(kill, restart, signals, the CLI) use ``process_cluster`` or
:class:`ServeProcess`.
"""

from __future__ import annotations

import asyncio
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

import pstrain
from pstrain.testing import InProcessCluster

TOKEN = "test-token-0123456789"

# aiohttp builds two TLS client contexts as it is imported, each reading the system's CA
# bundle: 0.08 s of CPU in each of the ~300 processes a test run starts (servers, the CLI).
# No test checks a certificate against the system's CAs (pstrain's TLS is checked against
# the CA each test makes), so the processes a test run starts read none.
os.environ.setdefault("SSL_CERT_FILE", os.devnull)
os.environ.setdefault("SSL_CERT_DIR", os.devnull)


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


class ServeProcess:
    """A `pstrain serve` process; `address` once it printed its listening line. ``limits``:
    resource limits (``resource.RLIMIT_*`` -> (soft, hard)) the process starts under."""

    def __init__(self, *args: str, token: str | None = TOKEN, env: dict[str, str] | None = None,
                 limits: dict[int, tuple[int, int]] | None = None) -> None:
        full_env = dict(os.environ if env is None else env)
        if token is not None:
            full_env["PSTRAIN_TOKEN"] = token
        full_env["PYTHONUNBUFFERED"] = "1"
        # stderr goes to a file: an unread pipe would fill up and block the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pstrain.cli", "serve", *args],
            stdout=subprocess.PIPE, stderr=self.log, env=full_env, text=True,
            preexec_fn=(lambda: [resource.setrlimit(k, v) for k, v in limits.items()]) if limits else None)
        try:
            self.address = self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"pstrain serve exited with {self.proc.wait()}: {self.stderr()}")
            match = re.search(r"listening on (\S+)", line)
            if match:
                return match.group(1)
        raise AssertionError("pstrain serve did not print its listening line in time")

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


@pytest.fixture
def ps_process() -> Iterator[ServeProcess]:
    """One `pstrain serve --role ps` process with the test token."""
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--checkpoint-root", "/tmp")
    yield server
    server.stop()


@pytest_asyncio.fixture
async def ps_server(tmp_path: Any) -> AsyncIterator[Any]:
    """One in-process ps with the test token; checkpoints go under ``tmp_path``."""
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN,
                                ps_options={"checkpoint_root": str(tmp_path)}) as c:
        yield c.ps[0]


@pytest_asyncio.fixture
async def ps_pair(tmp_path: Any) -> AsyncIterator[list[Any]]:
    """Two in-process ps with the test token; checkpoints go under ``tmp_path``."""
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN,
                                ps_options={"checkpoint_root": str(tmp_path)}) as c:
        yield c.ps


def strategy_for(*ps: Any, workers: list[str] | None = None,
                 token: str | None = TOKEN) -> pstrain.ParameterServerStrategy:
    """A strategy whose ps are the given servers (workers need not exist for ps tests)."""
    spec = {"ps": [s.address for s in ps], "worker": workers or ["127.0.0.1:9"]}
    return pstrain.ParameterServerStrategy(pstrain.SimpleClusterResolver(spec, token=token))


@pytest_asyncio.fixture
async def cluster(tmp_path: Any) -> AsyncIterator[InProcessCluster]:
    """2 ps + 2 workers as servers in this process, checked for leaks at teardown."""
    async with InProcessCluster(num_ps=2, num_workers=2,
                                ps_options={"checkpoint_root": str(tmp_path)}) as c:
        yield c


@pytest_asyncio.fixture
async def process_cluster() -> AsyncIterator[pstrain.LocalCluster]:
    """2 ps + 2 workers as real processes (for kills, restarts and signals)."""
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as c:
        yield c


def rss(pid: int) -> int:
    """The resident memory of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (sync or async) until true, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def abort_all(writers: list[asyncio.StreamWriter], timeout: float = 30.0) -> None:
    """Drop raw test connections and wait until each transport is closed, so none is left
    for a later test's loop (an open handle fails the loop's close and warns at collection)."""
    for w in writers:
        w.transport.abort()
    await asyncio.wait_for(
        asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True), timeout)
