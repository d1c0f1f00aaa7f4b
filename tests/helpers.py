"""What tests share besides fixtures: the test token, a ``pstrain serve`` process, waiting
on a condition, a process's memory. Test modules import these by name (``from tests.helpers
import wait_for``); the fixtures live in ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import pstrain
from pstrain._transport import wire
from pstrain.partitioners import FixedShardsPartitioner

#: The repository's root (tests sit in tiers below ``tests/``).
ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-0123456789"
MiB = 1 << 20


class ServeProcess:
    """A `pstrain serve` process; `address` once it printed its listening line. ``limits``:
    resource limits (``resource.RLIMIT_*`` -> (soft, hard)) the process starts under;
    ``wrapper``: a command that runs it (``unshare ...``), ``proc`` then that command's."""

    def __init__(
        self,
        *args: str,
        token: str | None = TOKEN,
        env: dict[str, str] | None = None,
        limits: dict[int, tuple[int, int]] | None = None,
        wrapper: list[str] | None = None,
    ) -> None:
        full_env = dict(os.environ if env is None else env)
        if token is not None:
            full_env["PSTRAIN_TOKEN"] = token
        full_env["PYTHONUNBUFFERED"] = "1"
        # stderr goes to a file: an unread pipe would fill up and block the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [*(wrapper or []), sys.executable, "-m", "pstrain.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=full_env,
            text=True,
            preexec_fn=(lambda: [resource.setrlimit(k, v) for k, v in limits.items()]) if limits else None,
        )
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


class Drill:
    """What a fault drill starts, stopped when the test ends however it ends: the fault
    drills' one fixture (``drill`` in ``conftest.py``).

    ``await drill.cluster(num_ps, num_workers, ...)`` starts a :class:`pstrain.LocalCluster`
    (its processes' output goes to the test's captured stderr, so a failing drill shows
    every task's log); ``drill.serve(...)`` starts a ``pstrain serve`` process (a task that
    joins, a ps started by hand); ``drill.job(argv)`` runs a coordinator script whose
    stdout the test reads. Each is stopped at teardown (SIGTERM, then SIGKILL), so a drill
    needs no ``try``/``finally`` of its own.
    """

    def __init__(self) -> None:
        self._clusters: list[pstrain.LocalCluster] = []
        self._servers: list[ServeProcess] = []
        self._jobs: list[subprocess.Popen[str]] = []

    async def cluster(self, num_ps: int = 2, num_workers: int = 2, **options: Any) -> pstrain.LocalCluster:
        cluster = pstrain.LocalCluster(num_ps=num_ps, num_workers=num_workers, **options)
        self._clusters.append(cluster)
        return await cluster.start()

    def serve(self, *args: str, **options: Any) -> ServeProcess:
        """A ``pstrain serve`` process, blocking until it listens (call it through
        ``asyncio.to_thread`` to keep the test's loop serving meanwhile)."""
        server = ServeProcess(*args, **options)
        self._servers.append(server)
        return server

    def job(self, argv: list[str], *, stdout: Any = subprocess.PIPE, **options: Any) -> subprocess.Popen[str]:
        """A process (a coordinator's script), its stdout a text pipe unless given."""
        proc = subprocess.Popen(argv, stdout=stdout, text=True, **options)
        self._jobs.append(proc)
        return proc

    async def close(self) -> None:
        for proc in self._jobs:
            if proc.poll() is None:
                proc.kill()
            await asyncio.to_thread(proc.communicate)
        for server in self._servers:
            await asyncio.to_thread(server.stop)
        for cluster in reversed(self._clusters):
            await asyncio.shield(cluster.stop())


def strategy_for(
    *ps: Any, workers: list[str] | None = None, token: str | None = TOKEN, shards: int | None = None
) -> pstrain.ParameterServerStrategy:
    """A strategy whose ps are the given servers (workers need not exist for ps tests);
    ``shards``: variables split in that many shards."""
    spec = {"ps": [s.address for s in ps], "worker": workers or ["127.0.0.1:9"]}
    partitioner = FixedShardsPartitioner(shards) if shards else None
    return pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver(spec, token=token), variable_partitioner=partitioner
    )


def table_feed_example() -> Any:
    """``examples/table_feed.py``, the serving feed's example consumer, as a module."""
    spec = importlib.util.spec_from_file_location("table_feed", ROOT / "examples" / "table_feed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """:func:`wait_for` outside an event loop: poll ``predicate`` until true, or fail after
    ``timeout`` seconds (for a condition no loop may be running for, such as the process's
    file descriptors, which a loop holds some of)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def abort_all(writers: list[asyncio.StreamWriter], timeout: float = 30.0) -> None:
    """Drop raw test connections and wait until each transport is closed, so none is left
    for a later test's loop (an open handle fails the loop's close and warns at collection)."""
    for w in writers:
        w.transport.abort()
    await asyncio.wait_for(
        asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True), timeout
    )


async def join_fails(
    coordinator: Any, error: type[BaseException], match: str, within: float = 10.0
) -> BaseException:
    """Schedule a closure and check that ``join`` raises ``error`` (matching ``match``)
    within ``within`` seconds; returns the error."""
    coordinator.schedule(lambda: 1)
    t = time.monotonic()
    with pytest.raises(error, match=match) as info:
        await asyncio.wait_for(coordinator.join(), within)
    assert time.monotonic() - t < within
    return info.value


async def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a raw test connection, whatever state the peer left it in."""
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


def wire_body(obj: Any) -> bytes:
    """``obj`` encoded as a request body, as a client sends it."""
    return b"".join(bytes(c) for c in wire.encode_body(obj))


async def http_post(address: str, op: str, data: bytes, token: str | None = TOKEN) -> tuple[int, bytes]:
    """POST ``data`` to operation ``op`` of a server over plain HTTP: (status, body)."""
    headers = {"Content-Type": "application/x-pstrain"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{address}/v1/{op}", data=data, headers=headers) as resp:
            return resp.status, await resp.read()


class Touch:
    """Unpickling this creates the file ``path``: proof that a payload reached an unpickler
    (or that a relayed pickle ran)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (Path.touch, (Path(self.path),))


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by openssl in ``directory``: (cert, key)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    cmd += ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run([*cmd, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key
