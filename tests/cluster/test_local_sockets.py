"""Same-host connections: a server on loopback also listens on a Unix socket in the
network namespace's abstract names, and a client dialling that loopback address uses it.
The connection is the same stream, sniffed and authenticated alike; without the socket
(``PSTRAIN_LOCAL_SOCKETS=0``, a name taken, TLS) both ends keep to TCP."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain._base.cluster import LOCAL_SOCKETS_ENV, local_listener, local_socket_name
from pstrain._transport.handshake import MAGIC
from pstrain.errors import AuthenticationError, PstrainError
from pstrain.server.ps import ParameterServer
from pstrain.testing import InProcessCluster, untyped_call
from tests.helpers import TOKEN, strategy_for, wait_for

pytestmark = pytest.mark.timeout(60)


def families(server) -> list[int]:
    return sorted(t.get_extra_info("socket").family for t in server.connections)


async def test_a_client_on_the_same_host_connects_through_the_local_socket():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        ch = rpc.Channel(ps.address, token=TOKEN, task="/job:ps/replica:0/task:0")
        await untyped_call(ch, "vars/list", {})
        assert socket.AF_UNIX in families(ps)
        # a whole step's traffic runs over it: a variable made, updated and read back
        async with strategy_for(ps).scope():
            v = pstrain.Variable(np.zeros((1000, 64), np.float32), name="v")
        await v.assign_add(np.ones((1000, 64), np.float32))
        np.testing.assert_array_equal(await v.numpy(), 1.0)
        await ch.close()


async def test_a_wrong_token_over_the_local_socket_is_refused_as_over_tcp():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        ch = rpc.Channel(ps.address, token="not the token", task="/job:ps/replica:0/task:0")
        with pytest.raises(AuthenticationError):
            await untyped_call(ch, "vars/list", {})
        await ch.close()
        # bytes that are no handshake: the connection is closed, the server serves on
        host, port = ps.address.rsplit(":", 1)
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.setblocking(False)
        raw.connect(local_socket_name(host, int(port)))
        reader, writer = await asyncio.open_unix_connection(sock=raw)
        writer.write(MAGIC[:4] + b"\xff" * 4096)
        await asyncio.wait_for(reader.read(), 10)  # the server closes it (else a timeout)
        assert reader.at_eof()
        writer.close()
        good = rpc.Channel(ps.address, token=TOKEN, task="/job:ps/replica:0/task:0")
        await untyped_call(good, "vars/list", {})
        await good.close()


async def test_without_local_sockets_both_ends_keep_to_tcp(monkeypatch):
    monkeypatch.setenv(LOCAL_SOCKETS_ENV, "0")
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        host, port = ps.address.rsplit(":", 1)
        monkeypatch.delenv(LOCAL_SOCKETS_ENV)  # the client would use one: the server has none
        probe = local_listener(local_socket_name(host, int(port)))
        assert probe is not None  # the server did not bind it
        probe.close()
        ch = rpc.Channel(ps.address, token=TOKEN, task="/job:ps/replica:0/task:0")
        await untyped_call(ch, "vars/list", {})
        await wait_for(lambda: set(families(ps)) == {socket.AF_INET}, 10, "a TCP connection only")
        await ch.close()


async def test_a_server_whose_local_socket_another_process_holds_does_not_start():
    """As with a taken port: clients on this host would reach the holder of the name."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    squatter = local_listener(local_socket_name("127.0.0.1", port))
    assert squatter is not None
    try:
        ps = ParameterServer(0, port=port, token=TOKEN)
        with pytest.raises(PstrainError, match="another process holds its local socket"):
            await ps.start()
        await ps.stop()
    finally:
        squatter.close()
    again = ParameterServer(0, port=port, token=TOKEN)  # the port was given back
    assert (await again.start()).endswith(f":{port}")
    await again.stop()


def test_a_taken_name_is_not_listened_on_twice_and_only_loopback_has_one():
    name = local_socket_name("127.0.0.1", 1)
    first = local_listener(name)
    assert first is not None
    try:
        assert local_listener(name) is None
    finally:
        first.close()
    assert local_socket_name("localhost", 5) == local_socket_name("127.0.0.1", 5)
    assert local_socket_name("10.1.2.3", 5) is None and local_socket_name("127.0.0.1", 0) is None
