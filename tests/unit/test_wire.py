"""The codec: bit-exact round trips, zero-copy decoding, clear errors on bad input."""

from __future__ import annotations

import colorsys
import fractions
import pickle
import struct
import sys

import msgpack
import numpy as np
import pytest

from pstrain._base.errors import ImportNeeded
from pstrain._formats.messages.closures import ClosureStatus
from pstrain._formats.messages.operations import RunClosures, Update, UpdateKind, UpdateVariables
from pstrain._formats.messages.records import (
    ClosureCall,
    ClosureResult,
    ResultsReply,
    convert_reply,
    validate,
)
from pstrain._transport import wire
from pstrain.errors import InvalidArgumentError, NotFoundError, ProtocolError

DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
]


def roundtrip(obj, **kw):
    return wire.decode_body(b"".join(bytes(c) for c in wire.encode_body(obj, **kw)), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_numeric_dtype_roundtrips_bit_exact(dtype):
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 5)) * 100).astype(dtype)
    out = roundtrip(arr)
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()


def test_nan_and_negative_zero_survive():
    arr = np.array([np.nan, -0.0, np.inf, -np.inf], np.float32)
    assert roundtrip(arr).tobytes() == arr.tobytes()


@pytest.mark.parametrize(
    "arr",
    [
        np.array(3.5, np.float32),
        np.zeros((0,), np.float32),
        np.zeros((0, 4), np.int64),
        np.zeros((2, 0, 3), np.float64),
        np.array(True),
    ],
)
def test_zero_d_and_empty_arrays(arr):
    out = roundtrip(arr)
    assert out.shape == arr.shape and out.dtype == arr.dtype
    assert np.array_equal(out, arr)


def test_non_contiguous_arrays():
    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    for view in (base[::2, 1::3], base.T, base[:, 3]):
        assert not view.flags.c_contiguous
        out = roundtrip(view)
        assert np.array_equal(out, view) and out.dtype == view.dtype


def test_numpy_scalars_keep_their_type():
    for scalar in (
        np.float32(1.5),
        np.int64(-7),
        np.uint8(200),
        np.bool_(True),
        np.float16(2.0),
        np.str_("ab"),
        np.str_(""),
        np.bytes_(b""),
        np.datetime64("2026-11-29"),
    ):
        out = roundtrip(scalar)
        assert type(out) is type(scalar) and out == scalar


def scalar_body(dtype_str, raw):
    """A body holding one scalar ext as a peer could craft it."""
    ext = msgpack.ExtType(wire._EXT_SCALAR, msgpack.packb((dtype_str, raw)))
    header = msgpack.packb(ext)
    return struct.pack("<II", len(header), 0) + header


@pytest.mark.parametrize(
    "dtype_str, raw",
    [
        ("f4,i4", b"\0" * 8),  # structured: a scalar that would answer s["field"]
        ("V4", b"\0" * 4),  # void
        ("<f4", b"\0" * 8),  # two values where one belongs
        ("<f4", b"\0" * 2),  # half of one
        ("<i8", b""),
        ("O", b"\0" * 8),
        (["<f4"], b"\0" * 4),  # not a dtype string
    ],
)
def test_crafted_scalars_are_refused(dtype_str, raw):
    assert wire.decode_body(scalar_body("<f4", b"\0\0\x80?")) == np.float32(1.0)  # the frame is right
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode_body(scalar_body(dtype_str, raw))


def test_nested_python_structures_keep_their_types():
    obj = {
        "t": (1, (2.5, None), [3, (4,)]),
        "l": [b"raw", "text", True, None],
        (1, "k"): {"inner": ()},
        7: [],
        "big": 2**70,
        "neg": -(2**65),
    }
    out = roundtrip(obj)
    assert out == obj
    assert type(out["t"]) is tuple and type(out["t"][1]) is tuple and type(out["t"][2]) is list
    assert type(out["t"][2][1]) is tuple and type(out[(1, "k")]["inner"]) is tuple


def test_arrays_inside_structures():
    a, b = np.arange(4, dtype=np.int32), np.ones((2, 2), np.float32)
    out = roundtrip({"xs": [a, (b, a)]})
    assert np.array_equal(out["xs"][0], a) and np.array_equal(out["xs"][1][0], b)


def test_decoding_is_zero_copy():
    arr = np.arange(1000, dtype=np.float64)
    body = bytearray(b"".join(bytes(c) for c in wire.encode_body({"a": arr})))
    out = wire.decode_body(body)["a"]
    assert np.shares_memory(out, np.frombuffer(body, np.uint8))
    assert out.flags.writeable  # a bytearray body gives writable arrays


def test_encoding_does_not_copy_contiguous_arrays():
    arr = np.arange(1 << 16, dtype=np.float32)
    chunks = wire.encode_body(arr)
    assert any(isinstance(c, memoryview) and np.shares_memory(np.asarray(c), arr) for c in chunks)


def test_buffers_are_aligned_to_8_bytes():
    body = b"".join(bytes(c) for c in wire.encode_body([np.ones(3, np.int8), np.ones(5, np.float64)]))
    out = wire.decode_body(body)
    base = np.frombuffer(body, np.uint8).ctypes.data
    for arr in out:
        assert (arr.ctypes.data - base) % 8 == 0


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x01\x00",
        b"\xff\xff\xff\x00\x00\x00\x00\x00",
        b"\x05\x00\x00\x00\x00\x00\x00\x00\xc1\xc1\xc1\xc1\xc1",
    ],
)
def test_malformed_bodies_raise_protocol_error(body):
    with pytest.raises(ProtocolError):
        wire.decode_body(body)


def test_truncated_buffer_is_detected():
    body = b"".join(bytes(c) for c in wire.encode_body(np.ones(100, np.float32)))
    with pytest.raises(ProtocolError, match="truncated"):
        wire.decode_body(body[:-40])


def test_pickles_refused_unless_allowed():
    class Thing:
        pass

    with pytest.raises(InvalidArgumentError, match="Thing"):
        wire.encode_body(Thing())
    body = b"".join(bytes(c) for c in wire.encode_body({"f": len}, allow_pickle=True))
    with pytest.raises(ProtocolError, match="pickled"):
        wire.decode_body(body)
    assert wire.decode_body(body, allow_pickle=True)["f"] is len


def test_a_decode_that_may_not_import_stops_before_importing_anything(monkeypatch):
    """A server's loop decodes with ``imports=False``: a pickle naming a module not imported
    yet (by reference, or a function's global that cloudpickle imports) raises
    ImportNeeded and imports nothing; the same body decodes where imports may happen."""

    def hue():
        return colorsys.rgb_to_hsv(0.0, 1.0, 0.0)[0]

    bodies = [
        b"".join(bytes(c) for c in wire.encode_body(obj, allow_pickle=True))
        for obj in ([1, fractions.Fraction(1, 3)], {"f": hue})
    ]
    for name in ("colorsys", "fractions"):
        monkeypatch.delitem(sys.modules, name)
    for body, module in zip(bodies, ("fractions", "colorsys"), strict=True):
        with pytest.raises(ImportNeeded, match=module):
            wire.decode_body(body, allow_pickle=True, imports=False)
        assert module not in sys.modules
    assert wire.decode_body(bodies[0], allow_pickle=True)[1] * 3 == 1
    assert wire.decode_body(bodies[1], allow_pickle=True)["f"]() == pytest.approx(1 / 3)
    # what names only modules already imported decodes at once
    assert wire.decode_body(bodies[0], allow_pickle=True, imports=False)[1] * 3 == 1


def test_object_arrays_refused_without_pickle():
    with pytest.raises(InvalidArgumentError, match="dtype object"):
        wire.encode_body(np.array([object()]))


def test_pstrain_errors_pickle_with_their_fields():

    err = pickle.loads(pickle.dumps(NotFoundError("gone", task="/job:ps/replica:0/task:1")))
    assert isinstance(err, NotFoundError) and err.task == "/job:ps/replica:0/task:1"


def test_closures_and_their_results_travel_as_compact_arrays_and_come_back_typed():

    body = b"".join(
        bytes(c)
        for c in wire.encode_body(
            ResultsReply(
                results=[
                    ClosureResult(3, ClosureStatus.OK, np.arange(2)),
                    ClosureResult(4, ClosureStatus.CANCELLED),
                ]
            )
        )
    )
    decoded = wire.decode_body(body)
    assert decoded["results"][1] == [4, 2, None]  # an array, the status as its value
    reply = convert_reply("worker/run", ResultsReply, decoded, "worker0")
    assert [r.status for r in reply.results] == [ClosureStatus.OK, ClosureStatus.CANCELLED]
    np.testing.assert_array_equal(reply.results[0].value, np.arange(2))

    sent = RunClosures(closures=[ClosureCall(1, b"d", (2,), {}, False)])
    got = validate(
        "worker/run", RunClosures, wire.decode_body(b"".join(bytes(c) for c in wire.encode_body(sent)))
    )
    assert got.closures == [ClosureCall(1, b"d", (2,), {}, False)]
    update = UpdateVariables(updates=[Update(op=UpdateKind.ASSIGN_ADD, name="v", value=np.ones(2))])
    raw = wire.decode_body(b"".join(bytes(c) for c in wire.encode_body(update)))
    assert raw["updates"][0]["op"] == "assign_add"
    with pytest.raises(InvalidArgumentError, match="status|Invalid enum"):
        validate("worker/run", ResultsReply, {"results": [[1, 7, None]]})


def _raise_at_unpickle():
    raise ValueError("not here")


class _RaisesAtUnpickle:
    def __reduce__(self):
        return (_raise_at_unpickle, ())


def test_an_object_that_cannot_be_unpickled_stands_as_its_failure_where_asked_and_the_rest_decodes():
    body = b"".join(
        bytes(c)
        for c in wire.encode_body(
            {"results": [[1, 0, 7], [2, 0, [3, _RaisesAtUnpickle()]]]}, allow_pickle=True
        )
    )
    with pytest.raises(ProtocolError, match="ValueError: not here"):  # the whole message, by default
        wire.decode_body(body, allow_pickle=True)
    results = wire.decode_body(body, allow_pickle=True, pickle_failures_kept=True)["results"]
    assert results[0] == [1, 0, 7] and results[1][2][0] == 3
    failure = results[1][2][1]
    assert isinstance(failure, wire.PickleFailure) and str(failure.error) == "not here"
