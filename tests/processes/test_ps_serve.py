"""A ``pstrain serve --role ps`` process: oversized requests, and unauthenticated bytes that
never reach the unpickler."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

import pstrain
from pstrain._transport import frames, wire
from pstrain.errors import (
    ProtocolError,
)
from tests.helpers import ServeProcess, Touch, http_post, strategy_for, wire_body

pytestmark = pytest.mark.timeout(60)


async def test_oversized_request_is_413_and_the_stream_stays_usable():
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--max-body", "4096")
    try:
        strategy = strategy_for(server)
        async with strategy.scope():
            w = pstrain.Variable(np.zeros(16, np.float32), name="w")
        status, reply = await http_post(
            server.address, "vars/assign", wire_body({"name": "w", "value": np.ones(4096, np.float32)})
        )
        assert status == 413 and json.loads(reply)["error"]["type"] == "ProtocolError"
        big = pstrain.Variable.handle("w", (4096,), np.float32, 0, strategy.channels)
        with pytest.raises(ProtocolError, match="larger than this server's limit"):
            await big.assign(np.ones(4096, np.float32))
        await w.assign_add(np.ones(16, np.float32))  # same connection, still fine
        np.testing.assert_array_equal(await w.numpy(), np.ones(16))
    finally:
        server.stop()


async def test_unauthenticated_requests_never_reach_the_unpickler(tmp_path):
    worker = ServeProcess("--role", "worker", "--index", "0", "--port", "0")
    try:
        marker = tmp_path / "unpickled"
        payload = b"".join(
            bytes(c)
            for c in wire.encode_body(
                {"fns": {b"d": b""}, "closures": [[1, b"d", (Touch(str(marker)),), {}, False]]},
                allow_pickle=True,
            )
        )
        for token in (None, "wrong"):
            status, _ = await http_post(worker.address, "worker/run", payload, token=token)
            assert status == 401
            assert not marker.exists()
        # Over the stream, a bad proof closes the connection before any frame is read.
        reader, writer = await asyncio.open_connection(*worker.address.rsplit(":", 1))
        op = b"worker/run"
        writer.write(
            frames.MAGIC
            + bytes(32)
            + b"\x00"
            + b"not the proof of the token......"
            + frames.FRAME.pack(1, frames.FrameKind.REQUEST, 0, len(op), len(payload))
            + op
            + payload
        )
        await writer.drain()
        answer = b""
        while chunk := await reader.read(4096):
            answer += chunk
        assert len(answer) == len(frames.MAGIC) + 32 + 1 and answer.endswith(frames.REJECTED)
        writer.close()
        await writer.wait_closed()
        assert not marker.exists()
        # The same payload with the token does reach it (so the test can fail).
        status, _ = await http_post(worker.address, "worker/run", payload)
        assert marker.exists()
    finally:
        worker.stop()
