"""Each operation is declared once (pstrain._formats.messages.operations): its request class names
its op, its reply class and whether it carries pickles; servers route by class, clients get
the declared reply back, typed."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pstrain._formats.messages.operations import OPERATIONS, ReadVariables, Request
from pstrain._formats.messages.records import Mutation, Operation, Record, Reply
from pstrain._serving.base import ServerBase
from pstrain._transport.channels import Channel
from pstrain.errors import InvalidArgumentError, ProtocolError
from pstrain.testing import untyped_call
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(60)

#: Operations whose reply is a free-form mapping (counters for people and Prometheus).
FREE_FORM = {"statistics", "dyn/stats", "dyn/export"}


def test_every_operation_names_its_reply():
    for op, cls in OPERATIONS.items():
        assert cls.op() == op
        assert cls.reply is not None or op in FREE_FORM, f"{op} declares no reply"


def test_the_operations_that_change_variables_carry_the_fence_and_once_fields():
    mutations = {op for op, cls in OPERATIONS.items() if issubclass(cls, Mutation)}
    assert mutations == {
        "vars/update",
        "vars/assign",
        "vars/assign_add",
        "vars/assign_sub",
        "vars/scatter_add",
        "vars/scatter_sub",
        "vars/scatter_mul",
        "vars/scatter_div",
        "vars/scatter_min",
        "vars/scatter_max",
        "vars/scatter_update",
        "opt/apply",
        "vars/call",
    }
    for op in mutations:
        assert {"owner", "fence", "once"} <= set(OPERATIONS[op].__struct_fields__)


def test_the_tagged_union_decodes_any_request_by_its_op():
    req = msgspec.convert({"op": "vars/read", "names": ["w"]}, Request)
    assert req == ReadVariables(names=["w"])
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"op": "vars/nope", "names": ["w"]}, Request)


# -- adding an operation: one declaration, one handler -----------------------------------------
class EchoReply(Reply):
    text: str
    times: int


class Echo(Operation, tag="test/echo"):
    reply = EchoReply
    text: str
    times: int = 1


class BadEcho(Operation, tag="test/bad_echo"):
    reply = EchoReply


class ArrayEcho(Operation, tag="test/array_echo"):
    reply = EchoReply


class Item(Record):
    n: int


class Sum(Operation, tag="test/sum"):
    reply = EchoReply
    items: list[Item]


class EchoServer(ServerBase):
    def __init__(self) -> None:
        super().__init__("ps", 0, token=TOKEN)
        self.route(Echo, lambda req: {"text": req.text * req.times, "times": req.times})
        self.route(BadEcho, lambda req: {"text": 3})  # a reply not of its declared shape
        self.route(ArrayEcho, lambda req: np.arange(3))  # an array where the reply's map belongs
        self.route(Sum, lambda req: {"text": "sum", "times": sum(i.n for i in req.items)})


async def test_a_new_operation_is_one_declaration_and_one_handler():
    server = EchoServer()
    await server.start()
    channel = Channel(server.address, token=TOKEN, task=server.task)
    try:
        reply = await channel.request(Echo(text="ab", times=2))
        assert isinstance(reply, EchoReply) and reply == EchoReply(text="abab", times=2)
        # nested records travel as maps and arrive as records
        assert (await channel.request(Sum(items=[Item(2), Item(3)]))).times == 5
        # the server checks the declared fields before the handler runs
        with pytest.raises(InvalidArgumentError, match="test/echo: Expected `str`"):
            await untyped_call(channel, "test/echo", {"text": 5})
        with pytest.raises(InvalidArgumentError, match="unknown field `colour`"):
            await untyped_call(channel, "test/echo", {"text": "a", "colour": "red"})
        # the client checks the reply against its declared class
        with pytest.raises(ProtocolError, match="malformed reply to test/bad_echo"):
            await channel.request(BadEcho())
        # an array or a numpy scalar where a record belongs is refused as such, whatever
        # msgspec does with objects that have __getitem__ (0.23 reads fields from them)
        with pytest.raises(InvalidArgumentError, match="test/echo: Expected `object`, got `numpy.ndarray`"):
            await untyped_call(channel, "test/echo", np.zeros(0, np.float32))
        with pytest.raises(InvalidArgumentError, match="test/sum: Expected `object`, got an array"):
            await untyped_call(channel, "test/sum", {"items": [{"n": 1}, np.float32(2)]})
        with pytest.raises(ProtocolError, match="malformed reply to test/array_echo"):
            await channel.request(ArrayEcho())
        assert server.internal_errors == 0
    finally:
        await channel.close()
        await server.stop()
