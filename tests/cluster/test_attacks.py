"""Attacks on real servers, as an attacker would make them: every one is refused, the server
stays up, memory stays bounded by what was sent, and a refused request changes nothing.

Memory and descriptor attacks run against `pstrain serve` processes (their RSS is read from
/proc); the rest against in-process servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct

import aiohttp
import cloudpickle
import msgpack
import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain._formats.files.checkpoint_files import write_index
from pstrain._formats.files.tensor_files import write_tensors
from pstrain._transport import frames, wire
from pstrain._transport.handshake import ClientHandshake
from pstrain.checkpoint import CheckpointManager, load_variables
from pstrain.errors import (
    AlreadyExistsError,
    AuthenticationError,
    InvalidArgumentError,
    NotFoundError,
    ProtocolError,
    PstrainError,
)
from pstrain.server.ps import ParameterServer
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, close_writer, strategy_for, wait_for

pytestmark = pytest.mark.timeout(60)


def test_deep_tuples_are_refused_when_encoding_too():
    obj: tuple = ()
    for _ in range(100):
        obj = (obj,)
    with pytest.raises(InvalidArgumentError, match="nested more than"):
        wire.encode_body(obj)


def test_buffer_indexes_out_of_range_are_refused():
    for index in (-1, 1, 2**40):
        header = msgpack.packb(msgpack.ExtType(2, msgpack.packb(("<f4", [1], index))))
        crafted = struct.pack("<IIQ", len(header), 1, 4) + header + bytes((-len(header)) & 7) + bytes(4)
        with pytest.raises(ProtocolError, match="buffer index"):
            wire.decode_body(crafted)


async def test_compressed_http_bodies_are_refused(ps_server):

    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"http://{ps_server.address}/v1/vars/list",
            data=b"\x1f\x8b" + bytes(30),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip"},
        ) as resp:
            assert resp.status == 415
            assert "Content-Encoding" in (await resp.json())["error"]["message"]


async def test_amplifying_reads_and_huge_variables_are_refused(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        table = pstrain.Variable(np.ones((1000, 256), np.float32), name="table")  # 1 KiB rows
    with pytest.raises(InvalidArgumentError, match="limit"):
        await table.sparse_read(np.zeros(100_000, np.int64))  # 100 MB from one row
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    spec = {
        "name": "huge",
        "dtype": "<f4",
        "shape": [1 << 28],
        "init": pstrain.initializers.RandomNormal(seed=1).spec(),
    }
    with pytest.raises(InvalidArgumentError, match="--max-variable-bytes"):
        await untyped_call(ch, "vars/create", {"vars": [spec]})
    assert [v["name"] for v in (await untyped_call(ch, "vars/list", {}))["variables"]] == ["table"]
    await ch.close()


async def test_initializers_run_off_the_serving_loop(ps_server):
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    spec = {
        "name": "big",
        "dtype": "<f4",
        "shape": [48 << 20],  # 192 MiB of normal draws
        "init": pstrain.initializers.RandomNormal(seed=1).spec(),
    }
    create = asyncio.ensure_future(untyped_call(ch, "vars/create", {"vars": [spec]}))
    await wait_for(
        lambda: ps_server.stats.get("vars/create") is None and not create.done(), what="the creation to start"
    )
    slowest = 0.0
    while not create.done():  # health is answered while the initializer runs
        t = asyncio.get_running_loop().time()
        await untyped_call(ch, "health", None, timeout=5)
        slowest = max(slowest, asyncio.get_running_loop().time() - t)
    await create
    assert slowest < 0.5
    await ch.close()


async def test_a_non_ascii_authorization_header_is_a_401(ps_server):
    host, port = ps_server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3\xa9\xff\r\n\r\n")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    assert b" 401 " in status_line
    await close_writer(writer)


# -- the token on the wire -------------------------------------------------------------------------
async def test_an_impostor_at_a_tasks_address_learns_nothing_and_is_refused():
    received = bytearray()

    async def impostor(reader, writer):
        # Pretend to be a ps: answer the hello with a challenge it cannot prove.
        received.extend(await reader.readexactly(len(hello)))
        writer.write(frames.MAGIC + os.urandom(32))  # a challenge; then it must prove itself
        received.extend(await reader.readexactly(32))  # the client's proof (it proves first)
        writer.write(frames.ACCEPTED + bytes([len(who)]) + who + os.urandom(32))
        try:
            while data := await reader.read(4096):
                received.extend(data)
        except ConnectionError:
            pass
        writer.close()

    hello = ClientHandshake(None, "/job:ps/replica:0/task:0").hello()
    who = b"/job:ps/replica:0/task:0#0"
    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret = "the-cluster-token-0123456789"
    ch = rpc.Channel(f"127.0.0.1:{port}", token=secret, task="/job:ps/replica:0/task:0")
    with pytest.raises(AuthenticationError, match="could not prove"):
        await untyped_call(ch, "vars/list", {})
    await ch.close()
    server.close()
    await server.wait_closed()
    assert secret.encode() not in received and len(received) == len(hello) + 32  # hello, proof


# -- validation after the fact ---------------------------------------------------------------------
async def test_refused_requests_change_nothing(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        pstrain.Variable(np.arange(4, dtype=np.float32), name="w")
        small = pstrain.Variable(np.zeros(2, np.int8), name="small")
        f32 = pstrain.Variable(np.zeros(2, np.float32), name="f32")
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    with pytest.raises(InvalidArgumentError, match="names"):
        await untyped_call(ch, "vars/delete", {"names": "w"})  # a string is not a list of names
    with pytest.raises(InvalidArgumentError, match="unknown field"):
        await untyped_call(ch, "vars/read", {"names": ["w"], "extra": 1})
    with pytest.raises(InvalidArgumentError, match="out of range"):
        await untyped_call(ch, "vars/assign", {"name": "small", "value": np.array([300, 1], np.uint64)})
    with pytest.raises(InvalidArgumentError, match="overflow"):
        await untyped_call(ch, "vars/assign", {"name": "f32", "value": np.array([1e300, 0.0])})
    with pytest.raises(InvalidArgumentError):
        await small.assign(np.array([300, 1], np.uint64))  # the client refuses too
    assert [v["name"] for v in (await untyped_call(ch, "vars/list", {}))["variables"]] == [
        "w",
        "small",
        "f32",
    ]
    assert (await small.numpy()).tolist() == [0, 0] and (await f32.numpy()).tolist() == [0.0, 0.0]
    await ch.close()


async def test_a_failing_optimizer_step_changes_nothing(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        a = pstrain.Variable(np.ones(3, np.float32), name="a")
        pstrain.Variable(np.ones(3, np.float32), name="b")
        opt = pstrain.optimizers.Adagrad(0.1)
    await strategy.flush()
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    request = {
        "rule": {"kind": "adagrad", "learning_rate": 0.1, "initial_accumulator_value": 0.1},
        "prefix": opt.name,
        "iterations": opt.iterations.name,
        "unique_rows": True,
        "grads": [["a", None, np.ones(3, np.float32)], ["b", None, np.ones(4, np.float32)]],
    }
    with pytest.raises(InvalidArgumentError, match="shape"):
        await untyped_call(ch, "opt/apply", request)
    names = {v["name"] for v in (await untyped_call(ch, "vars/list", {}))["variables"]}
    assert names == {"a", "b", opt.iterations.name}  # no slot was created
    assert await opt.iterations.numpy() == 0
    assert (await a.numpy()).tolist() == [1.0, 1.0, 1.0]
    await ch.close()


async def test_unexpected_errors_return_an_id_not_a_traceback(tmp_path):

    class Broken(ParameterServer):
        def list_variables(self, req):
            raise RuntimeError(f"failed reading {tmp_path}/secret.db")

    server = Broken(0, token=TOKEN)
    await server.start()
    try:
        ch = rpc.Channel(server.address, token=TOKEN, task="ps0")
        with pytest.raises(PstrainError, match=r"internal error [0-9a-f]{8}") as info:
            await untyped_call(ch, "vars/list", {})
        assert str(tmp_path) not in str(info.value) and not info.value.remote_traceback
        assert server.internal_errors == 1
        await ch.close()
    finally:
        await server.stop()


# -- checkpoints -----------------------------------------------------------------------------------
async def test_checkpoint_files_stay_under_the_root_and_are_never_overwritten(ps_server, tmp_path):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        pstrain.Variable(np.ones(3, np.float32), name="w")
    await strategy.flush()
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    outside = tmp_path.parent / "outside.safetensors"
    for path in (str(outside), f"{tmp_path}/../outside.safetensors", "relative.safetensors"):
        with pytest.raises(InvalidArgumentError):
            await untyped_call(ch, "ckpt/save", {"path": path, "tensors": {"w": "w"}})
    assert not outside.exists()
    existing = tmp_path / "existing.safetensors"
    existing.write_bytes(b"precious")
    with pytest.raises(AlreadyExistsError):
        await untyped_call(ch, "ckpt/save", {"path": str(existing), "tensors": {"w": "w"}})
    assert existing.read_bytes() == b"precious"
    with pytest.raises(NotFoundError):  # a failed save leaves no temporary file behind
        await untyped_call(
            ch, "ckpt/save", {"path": str(tmp_path / "new.safetensors"), "tensors": {"w": "nope"}}
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.safetensors"]
    await ch.close()


async def test_restore_checks_its_sources_and_is_all_or_nothing_across_ps(ps_pair, tmp_path):
    strategy = strategy_for(*ps_pair)
    async with strategy.scope():
        a = pstrain.Variable(np.zeros(4, np.float32), name="a")  # ps 0
        b = pstrain.Variable(np.zeros(4, np.float32), name="b")  # ps 1
    ckpt = pstrain.Checkpoint(a=a, b=b)
    path = await ckpt.save(str(tmp_path / "ckpt-1"))
    await a.assign(np.full(4, 7, np.float32))
    await b.assign(np.full(4, 7, np.float32))
    with open(f"{path}.ps1.safetensors", "r+b") as f:  # ps 1's file is damaged
        f.truncate(40)
    with pytest.raises(InvalidArgumentError):
        await ckpt.restore(path)
    assert (await a.numpy()).tolist() == [7] * 4  # ps 0 staged it, then dropped it
    # sources overlapping, outside the root, or not covering every row are refused unread
    ch = rpc.Channel(ps_pair[0].address, token=TOKEN, task="ps0")
    f0 = f"{path}.ps0.safetensors"
    for sources, message in (
        ([[f0, "a", 0, 3, 0], [f0, "a", 1, 4, 1]], "overlap"),
        ([[f0, "a", 0, 2, 0]], "cover"),
        ([["/etc/passwd", "a", None, None, None]], "outside"),
    ):
        with pytest.raises(InvalidArgumentError, match=message):
            await untyped_call(
                ch,
                "ckpt/restore",
                {"vars": [{"name": "a", "dtype": "<f4", "shape": [4], "sources": sources}]},
            )
    assert (await a.numpy()).tolist() == [7] * 4
    await ch.close()


async def test_a_malformed_index_is_a_clear_error_and_the_evaluator_skips_it(tmp_path):

    index = {
        "format": "pstrain-checkpoint",
        "version": 1,
        "variables": {"w": {"dtype": "<f4", "shape": "four", "parts": []}},
    }
    (tmp_path / "ckpt-1.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidArgumentError, match=r"shape"):
        load_variables(str(tmp_path / "ckpt-1"))
    index["variables"]["w"] = {
        "dtype": "<f4",
        "shape": [2],
        "parts": [{"file": "../../etc/passwd", "key": "w", "offset": 0, "rows": 2}],
    }
    (tmp_path / "ckpt-2.index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidArgumentError, match="file"):
        load_variables(str(tmp_path / "ckpt-2"))
    evaluated = []
    evaluator = pstrain.SidecarEvaluator(
        lambda v, i: evaluated.append(i), str(tmp_path), max_evaluations=1, poll_interval_s=0.05
    )
    task = asyncio.ensure_future(evaluator.run())
    await wait_for(lambda: not task.done() and len(evaluator.results) == 0, what="the evaluator to poll")

    write_tensors(str(tmp_path / "ckpt-3.local.safetensors"), {"it": np.array(5, np.int64)})
    write_index(
        str(tmp_path / "ckpt-3"),
        {
            "opt/iterations": {
                "dtype": "<i8",
                "shape": [],
                "parts": [{"file": "ckpt-3.local.safetensors", "key": "it", "offset": 0, "rows": 1}],
            }
        },
    )
    assert [it for _, it, _ in await asyncio.wait_for(task, 20)] == [5]
    assert CheckpointManager(None, str(tmp_path), max_to_keep=None).latest_checkpoint.endswith("ckpt-3")


def test_the_index_temp_file_is_unpredictable_and_a_planted_link_is_not_followed(tmp_path):

    victim = tmp_path / "victim"
    victim.write_text("precious")
    for guess in (f"ckpt-1.index.json.tmp-{os.getpid()}", "ckpt-1.index.json.tmp"):
        os.symlink(victim, tmp_path / guess)
    write_index(str(tmp_path / "ckpt-1"), {})
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / "ckpt-1.index.json").read_text())["variables"] == {}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


# -- the worker ------------------------------------------------------------------------------------
async def test_an_empty_run_is_answered_and_unknown_cancel_ids_are_ignored(cluster):
    ch = rpc.Channel(cluster.workers[0].address, token=cluster.token, task="w0")
    reply = await untyped_call(ch, "worker/run", {"fns": {}, "closures": []}, pickle=True, timeout=5)
    assert reply == {"results": []}
    assert (await untyped_call(ch, "worker/cancel", {"ids": [77]}))["cancelling"] == 0
    fn = wire.encode_body  # any picklable function of one argument

    digest = b"0123456789abcdef"
    reply = await untyped_call(
        ch,
        "worker/run",
        {"fns": {digest: cloudpickle.dumps(len)}, "closures": [[77, digest, ("abc",), {}, False]]},
        pickle=True,
        timeout=10,
    )
    assert reply["results"] == [[77, 0, 3]]  # id 77 ran: the earlier cancel was not kept
    del fn
    await ch.close()


async def test_a_reply_of_the_wrong_shape_is_a_protocol_error_on_the_client():

    class Lying(ParameterServer):
        def read(self, req):
            return {"values": "not arrays"}

    server = Lying(0, token=TOKEN)
    await server.start()
    try:
        ch = rpc.Channel(server.address, token=TOKEN, task="ps0")
        with pytest.raises(ProtocolError, match=r"malformed reply to vars/read from ps0"):
            await untyped_call(ch, "vars/read", {"names": ["w"]})
        await ch.close()
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "init",
    [
        {"kind": "random_normal", "stddev": "x"},
        {"kind": "random_normal", "seed": "s"},
        {"kind": "random_uniform", "minval": 1, "maxval": 0},
        {"kind": "nope"},
        {"kind": "zeros", "extra": 1},
    ],
)
async def test_bad_initializer_specs_are_refused_clearly(ps_server, init):
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    with pytest.raises(InvalidArgumentError, match="initializer"):
        await untyped_call(
            ch, "vars/create", {"vars": [{"name": "v", "dtype": "<f4", "shape": [3], "init": init}]}
        )
    assert (await untyped_call(ch, "vars/list", {}))["variables"] == [] and ps_server.internal_errors == 0
    await ch.close()
