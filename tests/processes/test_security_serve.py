"""Security of a ``pstrain serve`` process: relayed handshakes, floods, memory and descriptor limits."""

from __future__ import annotations

import asyncio
import os
import pickle
import resource

import numpy as np
import pytest

from pstrain import rpc
from pstrain._formats.files.tensor_files import write_tensors
from pstrain._transport import frames, wire
from pstrain._transport.handshake import (
    ACCEPTED,
    MAGIC,
    REJECTED,
    ClientHandshake,
)
from pstrain.errors import AuthenticationError, InvalidArgumentError, ResourceExhaustedError, WrongTaskError
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, MiB, ServeProcess, Touch, abort_all, rss

pytestmark = pytest.mark.timeout(120)


async def _relay(target: str, rewrite_target: str | None, injected: bytes, seen: list[bytes]):
    """A hostile process at a dead task's address: it forwards a client's handshake to the
    real task at ``target`` (optionally rewriting the task the client named), then sends a
    frame of its own on the connection."""
    thost, tport = target.rsplit(":", 1)

    async def handle(reader, writer):
        up_r, up_w = await asyncio.open_connection(thost, int(tport))
        hello = await reader.readexactly(len(MAGIC) + 32 + 1)
        name = await reader.readexactly(hello[-1])
        if rewrite_target is not None:
            name = rewrite_target.encode()
            hello = hello[:-1] + bytes([len(name)])
        up_w.write(hello + name)

        async def pump(src, dst, log):
            try:
                while data := await src.read(65536):
                    log.append(data)
                    dst.write(data)
                    if log is seen and ACCEPTED in data[:1]:
                        dst.write(injected)  # the relay's own frame, after an accepted proof
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_w, []), pump(up_r, writer, seen))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-sent", "target-rewritten"])
async def test_a_relayed_handshake_runs_nothing_on_another_task(tmp_path, rewrite):
    worker = ServeProcess("--role", "worker", "--index", "0", "--port", "0", "--log-level", "ERROR")
    marker = tmp_path / "ran"
    try:
        payload = b"".join(
            bytes(c)
            for c in wire.encode_body(
                {"fns": {b"d": pickle.dumps(Touch(str(marker)))}, "closures": [[1, b"d", (), {}, False]]},
                allow_pickle=True,
            )
        )
        op = b"worker/run"
        injected = frames.FRAME.pack(7, frames.FrameKind.REQUEST, 0, len(op), len(payload)) + op + payload
        seen: list[bytes] = []
        relay, address = await _relay(
            worker.address, "/job:worker/replica:0/task:0" if rewrite else None, injected, seen
        )
        # The coordinator believes it dials ps:0 (whose port the relay now holds).
        ch = rpc.Channel(address, token=TOKEN, task="/job:ps/replica:0/task:0")
        expected = AuthenticationError if rewrite else WrongTaskError
        with pytest.raises(expected):
            await untyped_call(ch, "vars/read", {"names": ["w"]})
        await ch.close()
        relay.close()
        await relay.wait_closed()
        await asyncio.sleep(0.5)  # the time a relayed pickle would take to run
        assert not marker.exists(), "a relayed frame ran code on the worker"
        assert not any(chunk[:1] == ACCEPTED for chunk in seen)  # the worker never accepted
    finally:
        worker.stop()


async def test_a_flood_of_hellos_does_not_starve_a_slow_legitimate_client():
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0", "--log-level", "ERROR")
    flood: list[asyncio.StreamWriter] = []
    writer: asyncio.StreamWriter | None = None
    try:
        host, port = server.address.rsplit(":", 1)
        shake = ClientHandshake(TOKEN.encode(), "/job:ps/replica:0/task:0")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(shake.hello())
        challenge = await reader.readexactly(len(MAGIC) + 32)
        hello = ClientHandshake(None, "/job:ps/replica:0/task:0").hello()
        # 400 token-less hellos while the legitimate client sits between its hello and its
        # proof: a count, not a rate, so a slow machine floods as hard as a fast one.
        for _ in range(400 // 25):
            for _ in range(25):
                _, w = await asyncio.open_connection(host, int(port))
                w.write(hello)
                flood.append(w)
            await asyncio.sleep(0)
        writer.write(shake.receive(challenge))  # the legitimate client proves last
        answer = await asyncio.wait_for(reader.read(4096), 10)
        assert answer[:1] == ACCEPTED, f"{len(flood)} hellos starved the client: {answer!r}"
        shake.receive(answer)
        assert shake.done
    finally:
        await abort_all([*flood, *([writer] if writer is not None else [])])
        server.stop()


async def test_no_byte_is_decoded_before_the_proof_even_after_a_valid_hello(tmp_path):
    """A frame sent right behind the hello (before any proof) is never read."""
    marker = tmp_path / "ran"
    worker = ServeProcess("--role", "worker", "--index", "0", "--port", "0", "--log-level", "ERROR")
    try:
        host, port = worker.address.rsplit(":", 1)
        payload = b"".join(
            bytes(c)
            for c in wire.encode_body(
                {"fns": {b"d": pickle.dumps(Touch(str(marker)))}, "closures": [[1, b"d", (), {}, False]]},
                allow_pickle=True,
            )
        )
        op = b"worker/run"
        frame = frames.FRAME.pack(1, frames.FrameKind.REQUEST, 0, len(op), len(payload)) + op
        reader, writer = await asyncio.open_connection(host, int(port))
        hello = ClientHandshake(None, "/job:worker/replica:0/task:0").hello()
        writer.write(hello + os.urandom(32) + frame + payload)
        answer = b""
        while chunk := await reader.read(4096):
            answer += chunk
        assert answer.endswith(REJECTED) and not marker.exists()
        writer.close()
    finally:
        worker.stop()


# -- every allocation bounded before it happens ------------------------------------------------


async def test_small_requests_cannot_make_a_ps_allocate_without_bound(tmp_path):

    server = ServeProcess(
        "--role",
        "ps",
        "--index",
        "0",
        "--port",
        "0",
        "--log-level",
        "ERROR",
        "--max-variable-bytes",
        str(MiB),
        "--checkpoint-root",
        str(tmp_path),
    )
    ch = rpc.Channel(server.address, token=TOKEN, task="/job:ps/replica:0/task:0")
    try:
        spec = {"name": "big", "dtype": "<f4", "shape": [MiB // 4], "init": {"kind": "zeros"}}
        await untyped_call(ch, "vars/create", {"vars": [spec]})
        before = rss(server.proc.pid)
        # one 1 MiB variable named 256 times in a 530-byte request
        with pytest.raises(InvalidArgumentError, match="named more than once"):
            await untyped_call(ch, "vars/read", {"names": ["big"] * 256})
        # a table 4096 wide: one lookup must not allocate thousands of rows ahead
        config = {"dim": 4096, "dtype": "float32"}
        with pytest.raises(InvalidArgumentError, match="max-variable-bytes"):
            await untyped_call(ch, "dyn/create", {"name": "t", "config": {**config, "capacity": 1000}})
        await untyped_call(ch, "dyn/create", {"name": "t", "config": config})
        await untyped_call(ch, "dyn/lookup", {"name": "t", "ids": np.array([7], np.int64)})
        with pytest.raises(InvalidArgumentError, match="max-variable-bytes"):
            await untyped_call(ch, "dyn/create", {"name": "wide", "config": {"dim": 1 << 20}})
        # a 1 MiB file listed as 96 row ranges of one variable: a 96 MiB variable
        path = str(tmp_path / "one.safetensors")
        write_tensors(path, {"x": np.zeros((1024, 256), np.float32)})
        sources = [[path, "x", 0, 1024, i * 1024] for i in range(96)]
        with pytest.raises(InvalidArgumentError, match="max-variable-bytes"):
            await untyped_call(
                ch,
                "ckpt/restore",
                {"vars": [{"name": "r", "dtype": "<f4", "shape": [96 * 1024, 256], "sources": sources}]},
            )
        # absurd shapes in an index are refused, not crashed on
        for shape in ([10**12], [1 << 40, 1 << 40]):
            with pytest.raises(InvalidArgumentError):
                await untyped_call(
                    ch,
                    "ckpt/restore",
                    {
                        "vars": [
                            {
                                "name": "s",
                                "dtype": "<f4",
                                "shape": shape,
                                "sources": [[path, "x", None, None, None]],
                            }
                        ]
                    },
                )
        with pytest.raises(InvalidArgumentError, match="scalar"):
            await untyped_call(
                ch,
                "ckpt/restore",
                {"vars": [{"name": "s", "dtype": "<f4", "shape": [], "sources": [[path, "x", 0, 1, 0]]}]},
            )
        # staged restores that are never committed: bounded in number
        small = [[path, "x", 0, 16, 0]]
        refused = 0
        for k in range(20):
            try:
                await untyped_call(
                    ch,
                    "ckpt/restore",
                    {
                        "stage": f"s{k}",
                        "vars": [{"name": f"st{k}", "dtype": "<f4", "shape": [16, 256], "sources": small}],
                    },
                )
            except InvalidArgumentError as exc:
                assert "staged" in str(exc)
                refused += 1
        assert refused == 16
        assert rss(server.proc.pid) - before < 16 * MiB
        names = {v["name"] for v in (await untyped_call(ch, "vars/list", {}))["variables"]}
        assert names == {"big"}  # nothing a refusal touched was created
    finally:
        await ch.close()
        server.stop()


async def test_a_ps_holds_no_more_than_its_store_limit(tmp_path):

    server = ServeProcess(
        "--role",
        "ps",
        "--index",
        "0",
        "--port",
        "0",
        "--log-level",
        "ERROR",
        "--max-variable-bytes",
        str(16 * MiB),
        "--max-store-bytes",
        str(48 * MiB),
    )
    ch = rpc.Channel(server.address, token=TOKEN, task="/job:ps/replica:0/task:0")
    try:
        before = rss(server.proc.pid)
        specs = [
            {"name": f"v{i}", "dtype": "<f4", "shape": [2 * MiB], "init": {"kind": "zeros"}}
            for i in range(12)
        ]  # 8 MiB each, generated on the ps
        for k in range(0, 12, 2):  # requests of 16 MiB, each within the per-request limit
            try:
                await untyped_call(ch, "vars/create", {"vars": specs[k : k + 2]})
            except ResourceExhaustedError as exc:
                assert "max-store-bytes" in str(exc) and k == 6  # the 4th would pass 48 MiB
                break
        else:
            raise AssertionError("the ps took more than its store limit")
        names = {v["name"] for v in (await untyped_call(ch, "vars/list", {}))["variables"]}
        assert names == {f"v{i}" for i in range(6)}  # the refused request created nothing
        assert rss(server.proc.pid) - before < 56 * MiB
    finally:
        await ch.close()
        server.stop()


async def test_one_small_request_cannot_create_many_variables_past_the_limit():

    server = ServeProcess(
        "--role",
        "ps",
        "--index",
        "0",
        "--port",
        "0",
        "--log-level",
        "ERROR",
        "--max-variable-bytes",
        str(16 * MiB),
    )
    ch = rpc.Channel(server.address, token=TOKEN, task="/job:ps/replica:0/task:0")
    try:
        before = rss(server.proc.pid)
        specs = [
            {"name": f"v{i}", "dtype": "<f4", "shape": [4 * MiB], "init": {"kind": "zeros"}}
            for i in range(24)
        ]  # 1.5 KB asking for 24 x 16 MiB
        with pytest.raises(InvalidArgumentError, match="per request"):
            await untyped_call(ch, "vars/create", {"vars": specs})
        assert (await untyped_call(ch, "vars/list", {}))["variables"] == []
        assert rss(server.proc.pid) - before < 16 * MiB
    finally:
        await ch.close()
        server.stop()


async def test_idle_connections_without_a_token_cannot_take_the_descriptors_clients_need():

    server = ServeProcess(
        "--role", "ps", "--index", "0", "--port", "0", limits={resource.RLIMIT_NOFILE: (512, 512)}
    )
    writers = []
    try:
        host, port = server.address.rsplit(":", 1)
        for _ in range(500):  # idle: no handshake, no request
            _, writer = await asyncio.open_connection(host, int(port))
            writers.append(writer)
        ch = rpc.Channel(server.address, token=TOKEN, task="/job:ps/replica:0/task:0")
        await asyncio.wait_for(
            untyped_call(
                ch,
                "vars/create",
                {
                    "vars": [
                        {
                            "name": "v",
                            "dtype": "<f4",
                            "shape": [3],
                            "value": np.array([1.0, 2.0, 3.0], np.float32),
                        }
                    ]
                },
            ),
            30,
        )
        values = (await asyncio.wait_for(untyped_call(ch, "vars/read", {"names": ["v"]}), 30))["values"]
        assert list(values[0]) == [1.0, 2.0, 3.0]
        await ch.close()
    finally:
        await abort_all(writers)
        server.stop()
