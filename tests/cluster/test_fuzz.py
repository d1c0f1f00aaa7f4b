"""Property-based fuzzing that stays in the suite (about a minute): the decoder, and every
operation's request validation against a real server.

Properties: the decoder returns or raises ProtocolError/InvalidArgumentError, whatever the
bytes; a server answers every request with a result or a pstrain error that is not an
internal error, stays up, and a refused request leaves every variable as it was.
``make fuzz`` runs the decoder under atheris for longer.
"""

from __future__ import annotations

import asyncio
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pstrain import rpc
from pstrain._formats.messages.operations import OPERATIONS
from pstrain._transport import wire
from pstrain._transport.bridge import new_event_loop
from pstrain.errors import InvalidArgumentError, ProtocolError, PstrainError
from pstrain.server.ps import ParameterServer
from pstrain.testing import untyped_call

pytestmark = pytest.mark.timeout(120)

TOKEN = "fuzz-token"
FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(st.binary(max_size=2048))
def test_the_decoder_survives_any_bytes(data):
    try:
        wire.decode_body(data)
    except (ProtocolError, InvalidArgumentError):
        pass


ext_codes = st.sampled_from([1, 2, 3, 4, 5, 6, 99])
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
)


def _packable(children):
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=4), children, max_size=3),
        st.builds(lambda c, x: msgpack.ExtType(c, msgpack.packb(x, default=_ext)), ext_codes, children),
    )


def _ext(obj):
    if isinstance(obj, msgpack.ExtType):
        return obj
    raise TypeError(type(obj))


@FUZZ
@given(st.recursive(leaves, _packable, max_leaves=20), st.lists(st.binary(max_size=64), max_size=3))
def test_the_decoder_survives_structured_garbage(header_obj, buffers):
    header = msgpack.packb(header_obj, default=_ext)
    head = (
        struct.pack("<II", len(header), len(buffers))
        + struct.pack(f"<{len(buffers)}Q", *(len(b) for b in buffers))
        + header
    )
    data = head + bytes((-len(head)) & 7) + b"".join(b + bytes((-len(b)) & 7) for b in buffers)
    try:
        wire.decode_body(data)
    except (ProtocolError, InvalidArgumentError):
        pass


arrays = st.builds(
    lambda dtype, n: (np.arange(n) - 2).astype(dtype),
    st.sampled_from(["<f4", "<f8", "<i4", "<i8", "<u8", "|i1", "|b1", "<c8"]),
    st.integers(0, 6),
)
values = st.recursive(
    st.one_of(leaves, arrays),
    lambda c: st.one_of(
        st.lists(c, max_size=3),
        st.dictionaries(
            st.sampled_from(
                [
                    "name",
                    "names",
                    "value",
                    "indices",
                    "values",
                    "op",
                    "vars",
                    "updates",
                    "reads",
                    "dtype",
                    "shape",
                    "init",
                    "rule",
                    "grads",
                    "prefix",
                    "iterations",
                    "t",
                    "path",
                    "tensors",
                    "kind",
                    "learning_rate",
                    "sources",
                    "stage",
                    "unique_rows",
                    "trainable",
                ]
            ),
            c,
            max_size=4,
        ),
    ),
    max_leaves=12,
)
names = st.sampled_from(["w", "n", "missing", ""])


def payloads():
    """Requests shaped like the real ones, with wrong and right parts mixed."""
    return st.one_of(
        values,
        st.fixed_dictionaries({"names": st.lists(names, max_size=3)}),
        st.fixed_dictionaries({"name": names, "value": arrays}),
        st.fixed_dictionaries({"name": names, "indices": arrays, "values": arrays}),
        st.fixed_dictionaries(
            {
                "updates": st.lists(
                    st.fixed_dictionaries(
                        {
                            "op": st.sampled_from(["assign", "assign_add", "scatter_add", "boom"]),
                            "name": names,
                            "value": arrays,
                        }
                    ),
                    max_size=3,
                )
            }
        ),
        st.fixed_dictionaries(
            {
                "rule": st.fixed_dictionaries(
                    {"kind": st.sampled_from(["sgd", "adam", "nope"]), "learning_rate": st.floats(-1, 1)}
                ),
                "prefix": st.just("opt"),
                "grads": st.lists(st.tuples(names, st.none() | arrays, arrays), max_size=2),
                "iterations": st.none() | names,
            }
        ),
    )


OPS = sorted(op for op in OPERATIONS if not op.startswith(("worker/", "coordinator/")) and op != "vars/call")


def test_every_operation_validates_whatever_it_is_sent(tmp_path):
    loop = new_event_loop()
    server = ParameterServer(0, token=TOKEN, checkpoint_root=str(tmp_path))
    ch = None

    async def start():
        nonlocal ch
        await server.start()
        ch = rpc.Channel(server.address, token=TOKEN, task="ps0")
        await untyped_call(
            ch,
            "vars/create",
            {
                "vars": [
                    {"name": "w", "dtype": "<f4", "shape": [4], "value": np.arange(4, dtype=np.float32)},
                    {"name": "n", "dtype": "<i4", "shape": [2], "value": np.array([1, 2], np.int32)},
                ]
            },
        )

    def snapshot():
        return {r.name: r.array.tobytes() for r in server.store}

    outcomes = {"ok": 0, "refused": 0}

    @settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.sampled_from(OPS), payloads())
    def one(op, payload):
        before = snapshot()
        try:
            loop.run_until_complete(untyped_call(ch, op, payload, timeout=10))
            outcomes["ok"] += 1
        except PstrainError as exc:
            assert "internal error" not in str(exc), (op, payload, exc)
            assert type(exc) is not PstrainError or op in ("ckpt/commit",), (op, payload, exc)
            outcomes["refused"] += 1
            assert snapshot() == before, (op, payload)  # a refused request changed nothing

    try:
        loop.run_until_complete(start())
        one()
        assert server.internal_errors == 0 and server.status.value == "running"
        assert outcomes["refused"] > 100  # the fuzzer did reach the validation
    finally:
        if ch is not None:
            loop.run_until_complete(ch.close())
        loop.run_until_complete(server.stop())
        loop.run_until_complete(rpc.close_loop_channels())
        loop.close()
        asyncio.set_event_loop(None)
