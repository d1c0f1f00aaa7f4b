"""Attacks on a ``pstrain serve`` process: hostile frames, claims and connections against the real server."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys

import msgpack
import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain._transport import frames, wire
from pstrain._transport.handshake import ClientHandshake
from pstrain.errors import (
    InvalidArgumentError,
    ProtocolError,
)
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, ServeProcess, Touch, abort_all, close_writer, rss, strategy_for

pytestmark = pytest.mark.timeout(60)


MiB = 1 << 20


def body(obj, allow_pickle=False) -> bytes:
    return b"".join(bytes(c) for c in wire.encode_body(obj, allow_pickle=allow_pickle))


def nested_tuples(depth: int) -> bytes:
    """A body whose header is ``depth`` tuples, each an ext inside the one around it."""
    data = msgpack.packb(None)
    for _ in range(depth):
        data = msgpack.packb(msgpack.ExtType(1, msgpack.packb([msgpack.ExtType(1, data)])))
    return struct.pack("<II", len(data), 0) + data


async def handshake(address: str, token: str | None = TOKEN, target: str = ""):
    """A raw stream connection past the mutual handshake (to send crafted frames)."""

    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    shake = ClientHandshake(token.encode() if token else None, target)
    writer.write(shake.hello())
    while not shake.done:
        data = await reader.read(4096)
        assert data, "the server closed the connection during the handshake"
        out = shake.receive(data)
        if out:
            writer.write(out)
    assert not shake.rest
    return reader, writer


@pytest.fixture
def ps_proc():
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--log-level", "ERROR")
    yield server
    server.stop()


async def alive_and_serving(server: ServeProcess) -> None:
    assert server.proc.poll() is None, server.stderr()
    ch = rpc.Channel(server.address, token=TOKEN, task="ps0", connect_timeout=5)
    try:
        assert (await untyped_call(ch, "health", None, timeout=5))["status"] == "running"
    finally:
        await ch.close()


# -- crash -----------------------------------------------------------------------------------------
async def test_deeply_nested_tuples_crash_neither_servers_nor_clients(tmp_path):
    crafted = nested_tuples(300)
    with pytest.raises(ProtocolError, match="nested more than"):
        wire.decode_body(crafted)  # what a client does with a reply shaped like this
    worker = ServeProcess("--role", "worker", "--index", "0", "--port", "0", "--log-level", "ERROR")
    ps = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--log-level", "ERROR")
    try:
        for server, op in ((ps, "vars/read"), (worker, "worker/run")):
            ch = rpc.Channel(server.address, token=TOKEN, task=op)
            kind, reply = await ch.call_raw(op, [crafted], timeout=10)
            with pytest.raises(ProtocolError, match="nested"):
                ch.decode_reply(kind, reply)
            await ch.close()
            assert server.proc.poll() is None, server.stderr()
        await alive_and_serving(ps)
    finally:
        worker.stop()
        ps.stop()


# -- memory ----------------------------------------------------------------------------------------
async def test_http_content_length_claims_cost_nothing(ps_proc):
    before = rss(ps_proc.proc.pid)
    host, port = ps_proc.address.rsplit(":", 1)
    writers = []
    for _ in range(3):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/vars/read HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Length: {512 * MiB}\r\nContent-Type: application/x-pstrain\r\n\r\n".encode()
            + b"0123456789abcdef"
        )
        await writer.drain()
        writers.append(writer)
    await alive_and_serving(ps_proc)  # served after the three claims were read
    assert rss(ps_proc.proc.pid) - before < 64 * MiB
    for writer in writers:
        await close_writer(writer)


async def test_stream_frame_claims_cost_nothing_and_a_stalled_body_is_dropped(ps_proc):
    before = rss(ps_proc.proc.pid)
    conns = []
    for _ in range(3):
        reader, writer = await handshake(ps_proc.address)
        op = b"vars/read"
        writer.write(
            frames.FRAME.pack(1, frames.FrameKind.REQUEST, 0, len(op), 512 * MiB) + op + b"0123456789abcdef"
        )
        await writer.drain()
        conns.append((reader, writer))
    await alive_and_serving(ps_proc)
    assert rss(ps_proc.proc.pid) - before < 64 * MiB
    for _, writer in conns:
        await close_writer(writer)


async def test_a_client_that_never_reads_its_replies_is_not_read_either(ps_proc):
    strategy = strategy_for(ps_proc)
    async with strategy.scope():
        table = pstrain.Variable(np.ones((4096, 256), np.float32), name="table")  # 4 MiB
    before = rss(ps_proc.proc.pid)
    reader, writer = await handshake(ps_proc.address)
    request = body({"name": "table", "indices": np.arange(4096)})  # a 4 MiB reply each
    op = b"vars/sparse_read"
    frame = frames.FRAME.pack(1, frames.FrameKind.REQUEST, 0, len(op), len(request)) + op + request
    for _ in range(1000):  # 4 GiB of replies, if they were all produced
        writer.write(frame)
    with pytest.raises(TimeoutError):  # the server stopped reading: our requests cannot drain
        await asyncio.wait_for(writer.drain(), 3)
    assert rss(ps_proc.proc.pid) - before < 64 * MiB
    np.testing.assert_array_equal(await table.sparse_read([0]), np.ones((1, 256)))  # others served
    writer.transport.abort()


# -- before authentication -------------------------------------------------------------------------
async def test_hostile_idle_connections_do_not_lock_out_a_client_and_are_closed():
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--log-level", "ERROR")
    try:
        host, port = server.address.rsplit(":", 1)
        idle = []
        openings = [b"", frames.MAGIC[:5], frames.MAGIC + bytes(10), b"POST /v1/vars/list HTTP/1.1\r\nHo"]
        for i in range(500):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(openings[i % len(openings)])
            idle.append((reader, writer))
        await alive_and_serving(server)  # a legitimate client gets in

        # every hostile connection is closed by the server (evicted, or after its deadline)
        async def closed(reader) -> bool:
            try:
                while await asyncio.wait_for(reader.read(4096), 10):
                    pass
            except (ConnectionError, OSError):
                pass
            return True

        assert all(await asyncio.gather(*(closed(r) for r, _ in idle)))
        await abort_all([w for _, w in idle])
        await alive_and_serving(server)
    finally:
        server.stop()


def test_an_empty_token_is_no_token(tmp_path):

    env = {k: v for k, v in os.environ.items() if not k.startswith("PSTRAIN_")}
    env["PSTRAIN_TOKEN"] = ""
    out = subprocess.run(
        [sys.executable, "-m", "pstrain.cli", "serve", "--role", "ps", "--host", "0.0.0.0", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0 and "without a cluster token" in out.stderr


async def test_no_pickle_refuses_functions_before_unpickling(tmp_path):
    server = ServeProcess(
        "--role", "ps", "--index", "0", "--port", "0", "--no-pickle", "--log-level", "ERROR"
    )
    try:
        strategy = strategy_for(server)
        async with strategy.scope():
            v = pstrain.Variable(np.zeros(3, np.float32), name="v")
        with pytest.raises(InvalidArgumentError, match="refuses pickled functions"):
            await strategy.extended.update(v, lambda a: a.fill(1))
        marker = tmp_path / "unpickled"
        ch = rpc.Channel(server.address, token=TOKEN, task="ps0")
        with pytest.raises(InvalidArgumentError):
            await untyped_call(ch, "vars/call", {"fn": Touch(str(marker)), "vars": ["v"]}, pickle=True)
        assert not marker.exists() and (await v.numpy()).tolist() == [0, 0, 0]
        await ch.close()
    finally:
        server.stop()
