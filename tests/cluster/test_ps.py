"""The parameter server as a real process, through the public Variable API and raw HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain import rpc
from pstrain._formats.messages.operations import ListVariables
from pstrain._transport import wire
from pstrain._variables.variables import Variable
from pstrain.errors import (
    AlreadyExistsError,
    AuthenticationError,
    InvalidArgumentError,
    NotFoundError,
)
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, http_post, strategy_for, wire_body

pytestmark = pytest.mark.timeout(60)


async def test_every_endpoint_through_the_variable_api(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(np.arange(12, dtype=np.float32).reshape(4, 3), name="table")
        s = pstrain.Variable(5, name="count")
        g = pstrain.Variable(
            pstrain.initializers.RandomNormal(stddev=1.0, seed=7), shape=(1000, 4), name="generated"
        )
    assert v.device == "/job:ps/replica:0/task:0/device:CPU:0"
    assert s.dtype == np.int32 and v.shape == (4, 3)
    np.testing.assert_array_equal(await v.read_value(), np.arange(12, dtype=np.float32).reshape(4, 3))
    assert await s.numpy() == 5

    await v.assign(np.ones((4, 3), np.float32))
    await v.assign_add(np.full((4, 3), 2.0, np.float32))
    await v.assign_sub(np.full((4, 3), 0.5, np.float32))
    np.testing.assert_array_equal(await v.numpy(), np.full((4, 3), 2.5, np.float32))

    await v.scatter_update(pstrain.IndexedSlices(np.zeros((2, 3)), [0, 3]))
    await v.scatter_add(pstrain.IndexedSlices(np.ones((3, 3)), [1, 1, 2]))  # duplicates add up
    expected = np.array([[0, 0, 0], [4.5, 4.5, 4.5], [3.5, 3.5, 3.5], [0, 0, 0]], np.float32)
    np.testing.assert_array_equal(await v.numpy(), expected)
    np.testing.assert_array_equal(await v.sparse_read([[3, 1], [1, 1]]), expected[[[3, 1], [1, 1]]])

    local = pstrain.initializers.RandomNormal(stddev=1.0, seed=7)((1000, 4), np.float32)
    np.testing.assert_array_equal(await g.numpy(), local)  # generated on the ps, same numbers

    values = await pstrain.read_variables([v, s, g])
    np.testing.assert_array_equal(values[0], expected)
    assert values[1] == 5

    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    listing = {e.name: e for e in (await ch.request(ListVariables())).variables}
    assert set(listing) == {"table", "count", "generated"}
    assert tuple(listing["generated"].shape) == (1000, 4)
    stats = await ch.statistics()
    # The 16,000-byte table was generated on the ps: the create request carried only its spec.
    assert stats["requests"]["vars/create"]["bytes_in"] < 2000
    assert (await ch.health()).status == "running"
    await untyped_call(ch, "vars/delete", {"names": ["generated"]})
    with pytest.raises(NotFoundError, match="'generated' not found on /job:ps/replica:0/task:0"):
        await g.read_value()
    await ch.close()


async def test_eight_concurrent_clients_add_exactly(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        counter = pstrain.Variable(0.0, name="counter")
    clients = [rpc.ChannelPool(strategy.cluster_spec, TOKEN) for _ in range(8)]
    handles = [Variable.handle("counter", (), np.float32, 0, peers) for peers in clients]

    async def client(h):
        for _ in range(1000):
            await h.assign_add(1.0)

    await asyncio.gather(*(client(h) for h in handles))
    assert await counter.numpy() == 8000.0
    for peers in clients:
        await peers.close()


async def test_batched_update_with_one_bad_entry_changes_nothing(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        a = pstrain.Variable(np.zeros(3, np.float32), name="a")
        b = pstrain.Variable(np.zeros(3, np.float32), name="b")
    ch = rpc.Channel(ps_server.address, token=TOKEN, task="ps0")
    good = {"op": "assign_add", "name": "a", "value": np.ones(3, np.float32)}
    for bad, error in [
        ({"op": "assign_add", "name": "nope", "value": np.ones(3, np.float32)}, NotFoundError),
        ({"op": "assign", "name": "b", "value": np.ones(4, np.float32)}, InvalidArgumentError),
        (
            {"op": "scatter_add", "name": "b", "indices": np.array([5]), "values": np.ones((1,))},
            InvalidArgumentError,
        ),
        ({"op": "explode", "name": "b"}, InvalidArgumentError),
    ]:
        with pytest.raises(error):
            await untyped_call(ch, "vars/update", {"updates": [good, {**good, "name": "b"}, bad]})
    np.testing.assert_array_equal(await a.numpy(), np.zeros(3))
    np.testing.assert_array_equal(await b.numpy(), np.zeros(3))
    await untyped_call(ch, "vars/update", {"updates": [good, {**good, "name": "b"}]})
    np.testing.assert_array_equal(await b.numpy(), np.ones(3))
    await ch.close()


BAD_INPUTS = {
    "malformed msgpack": (
        "vars/update",
        b"\x04\x00\x00\x00\x00\x00\x00\x00\xc1\xc1\xc1\xc1",
        400,
        "ProtocolError",
    ),
    "truncated body": (
        "vars/update",
        wire_body({"updates": [{"op": "assign", "name": "w", "value": np.ones(64, np.float32)}]})[:-100],
        400,
        "ProtocolError",
    ),
    "wrong dtype": (
        "vars/assign",
        wire_body({"name": "w", "value": np.ones(4, np.complex64)}),
        400,
        "InvalidArgumentError",
    ),
    "float into int": (
        "vars/assign",
        wire_body({"name": "n", "value": np.ones(2, np.float64)}),
        400,
        "InvalidArgumentError",
    ),
    "wrong shape": (
        "vars/assign_add",
        wire_body({"name": "w", "value": np.ones(5, np.float32)}),
        400,
        "InvalidArgumentError",
    ),
    "row id out of range": (
        "vars/scatter_add",
        wire_body({"name": "w", "indices": np.array([1, 4]), "values": np.ones(2, np.float32)}),
        400,
        "InvalidArgumentError",
    ),
    "negative row id": (
        "vars/sparse_read",
        wire_body({"name": "w", "indices": np.array([-1])}),
        400,
        "InvalidArgumentError",
    ),
    "unknown variable": ("vars/read", wire_body({"names": ["missing"]}), 404, "NotFoundError"),
    "duplicate create": (
        "vars/create",
        wire_body({"vars": [{"name": "w", "dtype": "<f4", "shape": (4,), "value": np.zeros(4, np.float32)}]}),
        409,
        "AlreadyExistsError",
    ),
    "unknown operation": ("vars/frobnicate", wire_body({}), 404, "NotFoundError"),
    "pickled object": (
        "vars/read",
        b"".join(bytes(c) for c in wire.encode_body({"names": [len]}, allow_pickle=True)),
        400,
        "ProtocolError",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
async def test_bad_input_is_a_4xx_and_changes_nothing(ps_server, case):
    op, data, status, error_type = BAD_INPUTS[case]
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        w = pstrain.Variable(np.arange(4, dtype=np.float32), name="w")
        n = pstrain.Variable(np.array([1, 2], np.int32), name="n")
    got_status, reply = await http_post(ps_server.address, op, data)
    assert got_status == status, reply
    envelope = json.loads(reply)["error"]
    assert envelope["type"] == error_type and envelope["message"]
    np.testing.assert_array_equal(await w.numpy(), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(await n.numpy(), [1, 2])
    assert ps_server.status.value == "running"  # still serving


async def test_bad_input_raises_the_matching_error_on_the_client(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        w = pstrain.Variable(np.arange(4, dtype=np.float32), name="w")
    with pytest.raises(InvalidArgumentError, match="shape"):
        await w.assign(np.ones(3))
    with pytest.raises(InvalidArgumentError, match="complex64"):
        await w.assign(np.ones(4, np.complex64))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        await w.sparse_read([7])
    with pytest.raises(AlreadyExistsError, match="'w' already exists"):
        await untyped_call(
            rpc.Channel(ps_server.address, token=TOKEN, task="ps0"),
            "vars/create",
            {"vars": [{"name": "w", "dtype": "<f4", "shape": (4,), "value": np.zeros(4)}]},
        )
    np.testing.assert_array_equal(await w.numpy(), np.arange(4, dtype=np.float32))


async def test_requests_without_the_token_are_rejected(ps_server):
    data = wire_body({})
    assert (await http_post(ps_server.address, "vars/list", data, token=None))[0] == 401
    assert (await http_post(ps_server.address, "vars/list", data, token="wrong"))[0] == 401
    assert (await http_post(ps_server.address, "vars/list", data))[0] == 200
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{ps_server.address}/healthz") as resp:
            assert resp.status == 401
    # A client with another token proves first (the server gives no proof to check offline)
    # and is rejected.
    ch = rpc.Channel(ps_server.address, token="wrong", task="ps0")
    with pytest.raises(AuthenticationError, match="rejected the cluster token"):
        await untyped_call(ch, "vars/list", {})
    await ch.close()
    ch = rpc.Channel(ps_server.address, token=None, task="ps0")
    with pytest.raises(AuthenticationError):
        await untyped_call(ch, "vars/list", {})
    await ch.close()


async def test_large_variable_round_trips(ps_server):
    strategy = strategy_for(ps_server)
    data = np.random.default_rng(0).standard_normal(4 << 20).astype(np.float32)  # 16 MiB
    async with strategy.scope():
        big = pstrain.Variable(np.zeros_like(data), name="big")
    for _ in range(3):
        await big.assign(data)
        np.testing.assert_array_equal(await big.read_value(), data)
    await big.assign_add(np.ones_like(data))
    np.testing.assert_array_equal(await big.read_value(), data + 1)


async def test_reads_see_a_consistent_version_under_concurrent_updates(ps_server):
    strategy = strategy_for(ps_server)
    async with strategy.scope():
        v = pstrain.Variable(np.zeros(1 << 20, np.float32), name="v")  # 4 MiB: pinned, not copied
    other = rpc.ChannelPool(strategy.cluster_spec, TOKEN)
    writer = Variable.handle("v", (1 << 20,), np.float32, 0, other)

    async def write():
        for _ in range(30):
            await writer.assign_add(np.ones(1 << 20, np.float32))

    async def read():
        for _ in range(30):
            value = await v.read_value()
            assert value.min() == value.max()  # never half-updated

    await asyncio.gather(write(), read(), read())
    assert (await v.numpy())[0] == 30
    await other.close()


async def test_server_api_in_process():
    spec = {"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:0"]}
    server = pstrain.Server(spec, "ps", 0, port=0, token=TOKEN)
    address = await server.start()
    assert server.status is pstrain.server.Status.RUNNING and address.startswith("127.0.0.1:")
    strategy = pstrain.ParameterServerStrategy(
        pstrain.SimpleClusterResolver({"ps": [address], "worker": ["127.0.0.1:9"]}, token=TOKEN)
    )
    async with strategy.scope():
        v = pstrain.Variable(2.0)
    assert await v.numpy() == 2.0
    await pstrain.rpc.close_loop_channels()
    await server.stop()
    await server.join()
    assert server.status is pstrain.server.Status.CLOSED
    with pytest.raises(pstrain.errors.InvalidArgumentError, match="no server for job 'chief'"):
        pstrain.Server({"chief": ["127.0.0.1:0"], "ps": ["127.0.0.1:0"], "worker": ["h:1"]}, "chief", 0)
