"""The protocol is typed end to end: every operation declares its reply class, every
handler a server routes returns that class, no code builds an operation from a string or
dispatches on one, and untyped calls live only in ``pstrain.testing``.

mypy checks both ends of each operation (``Operation[Reply]``: ``channel.request`` returns
the reply, ``route`` accepts only a handler that returns it); these tests check what mypy
cannot see (a handler routed through a wrapper) and keep the strings out."""

from __future__ import annotations

import inspect
import re
import types
import typing

import pytest

from pstrain._coordinator.endpoint import CoordinatorEndpoint
from pstrain._formats.messages.operations import OPERATIONS, SINGLE_UPDATES, UpdateKind
from pstrain._formats.messages.records import Reply
from pstrain._serving.core import Encoded, Pinned
from pstrain.server.ps.handlers import ParameterServer
from pstrain.server.worker.executor import WorkerServer
from tests.helpers import ROOT

SERVERS = {
    "ps": lambda: ParameterServer(0, exit_on_shutdown=True),
    "worker": lambda: WorkerServer(0, exit_on_shutdown=True),
    "coordinator": lambda: CoordinatorEndpoint(lambda: {}, lambda address: 0, lambda: []),
}


def test_every_operation_declares_a_reply_record_or_is_free_form():
    free_form = {op for op, cls in OPERATIONS.items() if cls.reply is None}
    assert free_form == {"statistics", "dyn/stats", "dyn/export"}
    for op, cls in OPERATIONS.items():
        assert cls.reply is None or issubclass(cls.reply, Reply), op


def _returns(fn: typing.Any) -> typing.Any:
    fn = inspect.unwrap(fn)
    hints = typing.get_type_hints(fn)
    return hints.get("return")


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_every_routed_handler_returns_its_operations_reply_class(server):
    routed = SERVERS[server]()
    checked = 0
    for op, handler in routed.handlers.items():
        if handler.refused is not None:
            continue
        declared = handler.request.reply
        returned = _returns(handler.fn)
        union = typing.get_origin(returned) in (typing.Union, types.UnionType)
        allowed = set(typing.get_args(returned)) if union else {returned}
        if declared is None:
            assert allowed & {dict[str, typing.Any]}, f"{server} {op}: returns {returned}"
        else:
            assert allowed <= {declared, Pinned[declared], Encoded}, (
                f"{server} {op}: declared {declared.__name__}, the handler returns {returned}"
            )
        checked += 1
    assert checked >= {"ps": 35, "worker": 8, "coordinator": 6}[server]


def test_each_update_kind_has_its_class_and_travels_as_its_value():
    assert {cls.kind for cls in SINGLE_UPDATES.values()} == set(UpdateKind)
    assert all(cls.op() == f"vars/{kind.value}" for kind, cls in SINGLE_UPDATES.items())


#: Where the untyped call may be written: the module that provides it.
UNTYPED_HOME = ROOT / "pstrain" / "testing.py"
THIS = ROOT / "tests" / "unit" / "test_typed_protocol.py"
#: A call by an op name: `ch.call("vars/list", ...)`.
UNTYPED = re.compile(r"\.call\(\"")


def _sources() -> list:
    return [
        p for d in ("pstrain", "tests", "benchmarks", "examples", "fuzz") for p in (ROOT / d).rglob("*.py")
    ]


def test_no_operation_is_built_or_dispatched_by_its_name():
    built = re.compile(r"operation\(f[\"']|OPERATIONS\[f[\"']")
    dispatched = re.compile(r"\.op\(\)\s*(==|!=|\.startswith|in\b)|\.op\(\)\.removeprefix")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in (ROOT / "pstrain").rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if built.search(line) or dispatched.search(line)
    ]
    assert not found, found


def test_no_untyped_call_outside_pstrain_testing():
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in _sources()
        if p not in (UNTYPED_HOME, THIS)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if UNTYPED.search(line)
    ]
    assert not found, found
    assert "async def untyped_call(" in UNTYPED_HOME.read_text()
