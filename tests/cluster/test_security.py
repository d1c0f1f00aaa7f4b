"""The wire, round two: attacks on the handshake and the pre-auth stage, on real servers,
and property tests (hypothesis) of the handshake machines.

* a relayed handshake (a process holding a dead task's port forwards a client to
  another task) runs nothing and reads nothing;
* the client proves first: a server gives nothing checkable before the client's proof;
* authenticated HTTP connections follow the keep-alive and body deadlines, not the
  pre-auth ones, and a flood of unauthenticated connections neither drops them nor
  starves a slow legitimate handshake;
* rejected handshakes are logged once per interval, with a count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

import aiohttp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pstrain
from pstrain import rpc
from pstrain._transport import frames, wire
from pstrain._transport.handshake import (
    MAGIC,
    MAX_PREAUTH,
    REJECTED,
    WRONG_TASK,
    ClientHandshake,
    HandshakeFailed,
    ServerHandshake,
)
from pstrain.errors import AuthenticationError, InvalidArgumentError, WrongTaskError
from pstrain.testing import InProcessCluster, untyped_call
from tests.helpers import TOKEN, MiB, abort_all, wait_for

pytestmark = pytest.mark.timeout(120)


async def test_a_client_refuses_a_task_that_proves_the_token_but_is_not_the_one_dialled():
    async with InProcessCluster(num_ps=2, num_workers=1, token=TOKEN) as cluster:
        ps1 = cluster.ps[1].address
        ch = rpc.Channel(ps1, token=TOKEN, task="/job:ps/replica:0/task:0")  # ps1 is not ps0
        with pytest.raises(WrongTaskError, match=r"is /job:ps/replica:0/task:1, not"):
            await untyped_call(ch, "vars/list", {})
        await ch.close()


async def test_the_server_proves_nothing_before_the_client_does():
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        host, port = cluster.ps[0].address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        shake = ClientHandshake(b"a guess", "/job:ps/replica:0/task:0")
        writer.write(shake.hello())
        challenge = await reader.readexactly(len(MAGIC) + 32)
        assert challenge.startswith(MAGIC)  # a nonce, and nothing that depends on the token
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.3)  # no proof comes unasked
        writer.write(shake.receive(challenge))  # a proof made with the wrong token
        assert await reader.read(4096) == REJECTED  # and nothing else
        writer.close()


async def test_rejected_handshakes_are_logged_once_per_interval_with_a_count(caplog):
    caplog.set_level(logging.WARNING, logger="pstrain._transport.listener")
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        address = cluster.ps[0].address
        for _ in range(30):
            ch = rpc.Channel(address, token="wrong", task="/job:ps/replica:0/task:0")
            with pytest.raises(AuthenticationError):
                await untyped_call(ch, "vars/list", {})
            await ch.close()
        lines = [r for r in caplog.records if "rejected a stream connection" in r.getMessage()]
        assert len(lines) == 1
        assert cluster.ps[0].preauth.rejections.suppressed == 29


# -- deadlines by state --------------------------------------------------------------------------
async def _http(session, address, op, body: bytes | None = None, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"}
    if body is None:
        body = b"".join(bytes(c) for c in wire.encode_body({}))
    async with session.post(f"http://{address}/v1/{op}", data=body, headers=headers) as r:
        return r.status, await r.read()


async def test_an_authenticated_http_connection_keeps_its_keepalive_past_the_preauth_deadline():
    options = {"handshake_timeout_s": 0.5, "max_unauthenticated": 8}
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options) as c:
        address = c.ps[0].address
        connector = aiohttp.TCPConnector(limit=1, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            assert (await _http(session, address, "vars/list"))[0] == 200
            await asyncio.sleep(1.5)  # idle for 3x the pre-auth deadline: the behaviour tested
            status, _ = await _http(session, address, "vars/list")
            assert status == 200
            assert c.ps[0].preauth.expired == 0  # the kept-alive connection was never expired


async def test_an_authenticated_slow_body_and_a_flood_of_idle_connections():
    options = {"handshake_timeout_s": 0.5, "max_unauthenticated": 8}
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN, ps_options=options) as c:
        host, port = c.ps[0].address.rsplit(":", 1)
        body = b"".join(bytes(x) for x in wire.encode_body({}))
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/vars/list HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}"
            f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        await writer.drain()
        await wait_for(lambda: len(c.ps[0].preauth) == 0, what="the token checked on the headers")
        hostile = []
        for _ in range(20):  # more idle unauthenticated connections than the cap
            _, w = await asyncio.open_connection(host, int(port))
            hostile.append(w)
        await asyncio.sleep(1.0)  # the body takes twice the pre-auth deadline: the behaviour
        writer.write(body)
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert b" 200 " in status_line
        await abort_all([writer, *hostile])


async def test_a_request_that_gives_its_token_twice_or_a_json_body_is_refused_saying_so():
    """Two Authorization headers: which one counts is not guessed (the first was taken: a
    right one after a wrong one was refused, a wrong one after a right one let in); a JSON
    body to an operation is named as what it is, not decoded as pstrain's format."""
    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as c:
        url = f"http://{c.ps[0].address}/v1/vars/list"
        body = b"".join(bytes(x) for x in wire.encode_body({}))
        async with aiohttp.ClientSession() as session:
            for first, second in (("wrong", TOKEN), (TOKEN, "wrong"), (TOKEN, TOKEN)):
                headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
                async with session.post(url, data=body, headers=headers) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["message"] == "Authorization given more than once"
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with session.post(url, json={}, headers=auth) as r:
                assert r.status == 400
                message = (await r.json())["error"]["message"]
                assert (
                    "takes pstrain's wire format (application/x-pstrain" in message
                    and "not application/json" in message
                )
            async with session.post(url, data=body, headers=auth) as r:  # (aiohttp: octet-stream)
                assert r.status == 200


# -- the handshake machines, property-tested ------------------------------------------------------
tokens = st.one_of(st.none(), st.binary(min_size=1, max_size=40))
targets = st.sampled_from(["", "/job:ps/replica:0/task:0", "/job:worker/replica:0/task:3"])


def _run(client: ClientHandshake, server: ServerHandshake, tamper=None) -> None:
    """Exchange messages until one side finishes or fails; ``tamper(i, data)`` may change
    message ``i`` on the wire."""
    messages = [client.hello()]
    i = 0
    while True:
        data = messages[-1]
        if tamper is not None:
            data = tamper(i, data)
        if i % 2 == 0:
            out = server.receive(data)
            if not out:
                return  # the server waits for more: nothing more will come
            if server.rejected is not None:
                client.receive(out)  # the client reads the refusal (and raises)
                return
        else:
            out = client.receive(data)
            if client.done or not out:
                if client.done:
                    return
        messages.append(out)
        i += 1


@settings(max_examples=200, deadline=None)
@given(tokens, targets)
def test_both_ends_agree_with_the_same_token_and_the_right_task(token, target):
    task = target or "/job:ps/replica:0/task:0"
    server = ServerHandshake(token, task, "inc")
    client = ClientHandshake(token, target)
    _run(client, server)
    assert server.accepted and client.done and client.identity == f"{task}#inc"


@settings(max_examples=200, deadline=None)
@given(tokens, tokens)
def test_another_token_never_gets_in(client_token, server_token):
    if client_token == server_token:
        return
    server = ServerHandshake(server_token, "/job:ps/replica:0/task:0", "inc")
    client = ClientHandshake(client_token, "/job:ps/replica:0/task:0")
    with pytest.raises(HandshakeFailed, match="rejected"):
        _run(client, server)
    assert not server.accepted and not client.done


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2), st.integers(0, 300), st.integers(1, 255))
def test_any_byte_changed_on_the_wire_fails_the_handshake(message, position, xor):
    token = b"the-token"
    server = ServerHandshake(token, "/job:ps/replica:0/task:0", "inc")
    client = ClientHandshake(token, "/job:ps/replica:0/task:0")

    def tamper(i, data):
        if i != message or not data:
            return data
        j = position % len(data)
        return data[:j] + bytes([data[j] ^ xor]) + data[j + 1 :]

    try:
        _run(client, server, tamper)
    except HandshakeFailed:
        return  # the client saw it
    # the change broke the server's reading or proof check, or left it waiting for more
    assert not (server.accepted and client.done)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_the_server_end_never_accepts_noise_and_never_holds_much(data):
    server = ServerHandshake(b"k", "/job:ps/replica:0/task:0", "inc")
    for k in range(0, len(data), 37):
        if server.rejected is not None:
            break
        out = server.receive(data[k : k + 37])
        assert not server.accepted
        assert out[:1] in (b"", REJECTED, WRONG_TASK) or out.startswith(MAGIC)
        assert len(server.buf) <= MAX_PREAUTH


def test_a_relay_cannot_splice_two_handshakes():
    """A relay opens its own handshake with the server and forwards the client's proof
    into it: the proof covers the client's nonce and target, not the relay's."""
    token = b"k"
    client = ClientHandshake(token, "/job:ps/replica:0/task:0")
    client.hello()
    relay_side = ServerHandshake(token, "/job:ps/replica:0/task:0", "inc")
    relay = ClientHandshake(None, "/job:ps/replica:0/task:0")  # the relay has no token
    challenge = relay_side.receive(relay.hello())
    proof = client.receive(challenge)  # the client answers the challenge the relay passed on
    assert relay_side.receive(proof) == REJECTED


# -- budgets by bytes received -------------------------------------------------------------------
async def _raw_stream(address: str, target: str = "/job:ps/replica:0/task:0"):
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    shake = ClientHandshake(TOKEN.encode(), target)
    writer.write(shake.hello())
    while not shake.done:
        out = shake.receive(await reader.read(4096))
        if out:
            writer.write(out)
    return reader, writer


async def test_a_header_claiming_gigabytes_reserves_nothing():

    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        _, writer = await _raw_stream(ps.address)
        op = b"vars/create"
        writer.write(frames.FRAME.pack(1, frames.FrameKind.REQUEST, 0, len(op), 2 << 30) + op)
        await writer.drain()  # 2 GiB claimed, not a byte of it sent
        ch = rpc.Channel(ps.address, token=TOKEN, task="/job:ps/replica:0/task:0")
        big = np.ones(1 << 20, np.float32)  # a 4 MiB body: a large one, on the budget
        spec = {"name": "w", "dtype": "<f4", "shape": [1 << 20], "value": big}
        await asyncio.wait_for(untyped_call(ch, "vars/create", {"vars": [spec]}), 10)
        assert ps.budget.used == 0  # what the 4 MiB held went back; the claim never held any
        values = (await untyped_call(ch, "vars/read", {"names": ["w"]}))["values"]
        assert values[0].shape == (1 << 20,)
        await ch.close()
        writer.transport.abort()


# -- every allocation bounded before it happens ------------------------------------------------


# -- files opened once ----------------------------------------------------------------------
async def test_a_symlink_swapped_into_a_checkpoint_folder_never_redirects_a_save(tmp_path):
    """A hostile process with write access to the checkpoint folder replaces every temporary
    file it sees with a link to a file outside the root, as fast as it can, while the ps
    saves 80 times: no byte lands outside, and no save answers OK for a file it did not
    write."""

    root = tmp_path / "root"
    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    stop = threading.Event()
    swapped = [0]

    def attacker():
        while not stop.is_set():
            for entry in os.scandir(ckpt):
                if entry.name.endswith(".tmp") and not entry.is_symlink():
                    try:
                        os.unlink(entry.path)
                        os.symlink(outside, entry.path)
                        swapped[0] += 1
                    except OSError:
                        pass

    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(root)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            v = pstrain.Variable(np.arange(1 << 16, dtype=np.float32), name="v")
        thread = threading.Thread(target=attacker, daemon=True)
        thread.start()
        ok = failed = 0
        try:
            for i in range(80):
                try:
                    path = await pstrain.Checkpoint(v=v).write(str(ckpt / f"c{i}"))
                except pstrain.errors.PstrainError:
                    failed += 1
                    continue
                part = ckpt / f"c{i}.ps0.safetensors"
                assert not part.is_symlink()
                assert pstrain.checkpoint.load_variables(path)["v"][-1] == (1 << 16) - 1
                ok += 1
        finally:
            stop.set()
            thread.join(10)
        assert outside.read_bytes() == b""  # nothing was ever written outside the root
        assert ok + failed == 80 and swapped[0] > 0  # the attacker did race the saves


@pytest.mark.parametrize("shape", [[10**12], [1 << 40, 1 << 40], [-1, 4]])
async def test_an_index_with_absurd_shapes_is_refused_before_anything_is_allocated(tmp_path, shape):

    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": str(tmp_path)}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            v = pstrain.Variable(np.ones((4, 4), np.float32), name="v")
        ckpt = pstrain.Checkpoint(v=v)
        path = await ckpt.write(str(tmp_path / "c"))
        index = tmp_path / "c.index.json"
        doc = json.loads(index.read_text())
        doc["variables"]["v"]["shape"] = shape
        doc["variables"]["v"]["parts"][0]["rows"] = shape[0]
        index.write_text(json.dumps(doc))
        with pytest.raises(InvalidArgumentError, match="checkpoint index"):
            pstrain.checkpoint.load_variables(path)  # what the SidecarEvaluator reads
        with pytest.raises(InvalidArgumentError, match="checkpoint index"):
            await ckpt.restore(path)
        assert (await v.numpy()).tolist() == [[1.0] * 4] * 4  # nothing changed


async def test_a_model_larger_than_one_request_is_still_created_whole():

    async with InProcessCluster(
        num_ps=1, num_workers=1, token=TOKEN, ps_options={"max_variable_bytes": 4 * MiB}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():  # 20 variables of 2 MiB: 40 MiB on one ps, 4 MiB limit
            vs = [
                pstrain.Variable(
                    pstrain.initializers.Zeros(), shape=(MiB // 2,), dtype=np.float32, name=f"v{i}"
                )
                for i in range(20)
            ]
        values = await pstrain.read_variables(vs[:2])
        assert all(v.shape == (MiB // 2,) for v in values)
        assert len(cluster.ps[0].store) == 20


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))


async def test_headers_claiming_gigabytes_reserve_address_space_only_as_bytes_arrive():

    async with InProcessCluster(num_ps=1, num_workers=1, token=TOKEN) as cluster:
        ps = cluster.ps[0]
        before = _vm_size()
        writers = []
        op = b"vars/create"
        for _ in range(20):  # 20 x 2 GiB claimed, a byte of each sent
            _, writer = await _raw_stream(ps.address)
            writer.write(frames.FRAME.pack(1, frames.FrameKind.REQUEST, 0, len(op), 2 << 30) + op + b"\x00")
            writers.append(writer)
        await wait_for(lambda: ps.budget.used >= 20, 10, "every claim's first byte read")
        grown = _vm_size() - before
        assert grown < 1 << 30, f"{grown >> 20} MiB of address space for 20 bytes received"
        assert ps.budget.used <= 20 * frames.FIRST_BODY_BUFFER
        ch = rpc.Channel(ps.address, token=TOKEN, task="/job:ps/replica:0/task:0")
        big = np.ones(16 << 20, np.float32)  # a legitimate 64 MiB body beside them
        spec = {"name": "w", "dtype": "<f4", "shape": [16 << 20], "value": big}
        await asyncio.wait_for(untyped_call(ch, "vars/create", {"vars": [spec]}), 30)
        values = (await untyped_call(ch, "vars/read", {"names": ["w"]}))["values"]
        assert values[0].shape == (16 << 20,) and float(values[0][-1]) == 1.0
        await ch.close()
        await abort_all(writers)
        await wait_for(lambda: ps.budget.used == 0, 10, "the claims' buffers released")
