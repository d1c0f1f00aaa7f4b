"""A server's HTTP face is set up by the first connection that is not the stream.

Connections that arrive before it is up wait for it, reading paused, and are answered
once it is; one that leaves meanwhile, or a server that stops meanwhile, harms nothing.
(That a ``pstrain serve`` process loads aiohttp only then: ``tests/processes/
test_import_costs.py``.)
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np

import pstrain
from pstrain.server.ps import ParameterServer
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, strategy_for, wait_for

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: ps\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"


async def test_the_first_http_connections_all_wait_for_the_face_and_are_answered():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        strategy = strategy_for(ps)
        async with strategy.scope():
            v = pstrain.Variable(np.arange(4, dtype=np.float32), name="v")
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession() as session:

            async def get(path: str, auth: bool = True) -> int:
                async with session.get(f"http://{ps.address}{path}", headers=headers if auth else {}) as r:
                    await r.read()
                    return r.status

            # Ten at once, before the face exists, with the stream busy beside them.
            statuses, value = await asyncio.gather(
                asyncio.gather(*[get("/healthz") for _ in range(8)], get("/metrics"), get("/healthz", False)),
                v.numpy(),
            )
            assert statuses == [200] * 9 + [401]
            np.testing.assert_array_equal(value, np.arange(4, dtype=np.float32))
            assert await get("/healthz") == 200  # and once it is up


async def test_a_connection_that_leaves_while_the_face_starts_harms_nothing():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        host, port = ps.address.rsplit(":", 1)
        for _ in range(3):  # sniffed as HTTP, then gone before any answer
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /hea")
            await writer.drain()
            writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(REQUEST)
        status = await asyncio.wait_for(reader.readline(), 30)
        assert status.startswith(b"HTTP/1.1 200"), status
        writer.close()
        await wait_for(lambda: len(ps.preauth) == 0, what="the waiting connections to leave pre-auth")


async def test_a_server_stopped_while_a_connection_waits_for_the_face_closes_it():
    ps = ParameterServer(0, token=TOKEN)
    await ps.start()
    host, port = ps.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(REQUEST)
    await writer.drain()
    await asyncio.wait_for(ps.stop(), 30)
    # Closed, answered or not (the face may have come up first): never left hanging.
    rest = await asyncio.wait_for(reader.read(), 30)
    assert rest == b"" or rest.startswith(b"HTTP/1.1 200"), rest
    writer.close()
    assert len(ps.connections) == 0
