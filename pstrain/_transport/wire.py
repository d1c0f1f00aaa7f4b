"""Message encoding: a msgpack header followed by raw tensor buffers.

A *body* is laid out as::

    u32 header_len | u32 n_buffers | n_buffers x u64 length | header | buffers

Each buffer starts at an 8-byte aligned offset of the body. The header is
msgpack; arrays inside it are ext objects naming ``(dtype, shape, buffer
index)``, so no array ever becomes a Python list, and decoding is
``np.frombuffer`` on the received bytes: no copy. Arrays decoded from an
immutable ``bytes`` body are read-only; copy before updating in place.

Python structures keep their types: tuples stay tuples (an ext, since msgpack
has one array type), lists stay lists, dict keys may be any encodable
hashable, numpy scalars come back as numpy scalars. Any other object is
cloudpickled into an ext *only* when the caller allows pickles; a decoder that
does not allow them refuses the message before unpickling anything.

No I/O here: the codec turns objects into byte chunks and back.
"""

from __future__ import annotations

import enum
import struct
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec
import numpy as np

from .._base.errors import ImportNeeded, InvalidArgumentError, ProtocolError

__all__ = [
    "PickleFailure",
    "body_size",
    "decode",
    "decode_body",
    "encode",
    "encode_body",
    "pickle_failure_in",
]

_EXT_TUPLE = 1
_EXT_ARRAY = 2
_EXT_SCALAR = 3
_EXT_PICKLE = 4
_EXT_BIGINT = 5

_PREFIX = struct.Struct("<II")
#: dtype kinds that travel as raw buffers.
_BUFFER_KINDS = frozenset("biufc?SUMm")
#: What subclasses of plain types travel as, when pickles are not allowed.
_PLAIN_TYPES: tuple[type[Any], ...] = (bool, int, float, str, bytes, dict, list)
#: Deepest nesting of tuples (each one an ext inside its parent) a message may have. Each
#: level is a recursion through the C unpacker: unbounded, ~250 levels overflow the C stack.
MAX_DEPTH = 32
#: Largest number of buffers one message may carry (a sanity limit).
MAX_BUFFERS = 1 << 20


def _pad(n: int) -> int:
    return (-n) & 7


class PickleFailure:
    """In the place of a pickled object that could not be rebuilt here (decoded with
    ``pickle_failures_kept``): ``error`` says why. A closure's result is one: it fails that
    closure alone, not the message it came in with the others'."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __repr__(self) -> str:
        return f"PickleFailure({self.error!r})"


def pickle_failure_in(value: Any) -> PickleFailure | None:
    """The first :class:`PickleFailure` in ``value`` (in its lists, tuples and dicts), or
    None. (Only plain lists, tuples and dicts can hold one: a pickled container is rebuilt
    whole or fails whole. Checked for every closure, both ways: a walk of exact types.)"""
    kind = type(value)
    if kind is tuple or kind is list:
        for item in value:
            found = pickle_failure_in(item)
            if found is not None:
                return found
        return None
    if kind is dict:
        for item in value.values():
            found = pickle_failure_in(item)
            if found is not None:
                return found
        return None
    return value if kind is PickleFailure else None


class _Encoder(threading.local):
    """Per-thread encoding state; packers are reused because building one
    allocates its buffer, which costs more than packing a small message."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.allow_pickle = False
        self.depth = 0
        self.packers: list[msgpack.Packer] = []
        #: packs an array's (dtype, shape, buffer index): one per thread, not one per array
        self.meta = msgpack.Packer()  # (as msgpack.packb packs: a tuple as an array)

    def pack(self, obj: Any) -> bytes:
        depth = self.depth
        if depth >= MAX_DEPTH:
            raise InvalidArgumentError(f"cannot encode message: tuples nested more than {MAX_DEPTH} deep")
        if depth == len(self.packers):
            self.packers.append(msgpack.Packer(default=_default, strict_types=True, use_bin_type=True))
        self.depth = depth + 1
        try:
            return self.packers[depth].pack(obj)
        except (OverflowError, ValueError) as exc:
            self.packers[depth].reset()
            raise InvalidArgumentError(f"cannot encode message: {exc}") from exc
        except BaseException:
            self.packers[depth].reset()
            raise
        finally:
            self.depth = depth


_enc = _Encoder()


def _pickle(obj: Any) -> msgpack.ExtType:
    from .._formats.messages import pickling  # deferred: only peers that may execute code need cloudpickle

    return msgpack.ExtType(_EXT_PICKLE, pickling.dumps_object(obj))


def _array(arr: np.ndarray) -> msgpack.ExtType:
    if arr.dtype.kind not in _BUFFER_KINDS or arr.dtype.fields is not None:
        if _enc.allow_pickle:
            return _pickle(arr)
        raise InvalidArgumentError(
            f"arrays of dtype {arr.dtype} cannot travel; use a numeric, bool or string dtype"
        )
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    buffers = _enc.buffers
    index = len(buffers)
    buffers.append(arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b""))
    # (ExtType's own constructor checks its two fields' types in Python: these are an int
    # and bytes by construction, and an array is the one ext a message holds many of)
    return _ext(_EXT_ARRAY, _enc.meta.pack((arr.dtype.str, arr.shape, index)))


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(code, data)`` for a ``code`` and ``data`` known to be an int in
    range and bytes."""
    return tuple.__new__(msgpack.ExtType, (code, data))


def _record(obj: msgspec.Struct) -> dict[str, Any] | list[Any]:
    """A message record (``pstrain._formats.messages.operations``) as the map it travels as: every
    field (the tag, the op name, travels in the frame); a record declared ``array_like`` as the
    array of its fields. ``asdict`` runs in C: leaving out the fields at their default would
    cost more time than the few bytes it saves."""
    if obj.__struct_config__.array_like:  # (a closure and its result: compact, as declared)
        return list(msgspec.structs.astuple(obj))
    fields = msgspec.structs.asdict(obj)
    for name, value in fields.items():  # a batch of array-like records: in one pass, not one hook each
        if (
            type(value) is list
            and value
            and isinstance(value[0], msgspec.Struct)
            and value[0].__struct_config__.array_like
        ):
            fields[name] = [list(msgspec.structs.astuple(v)) for v in value]
    return fields


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _array(obj)
    if isinstance(obj, msgspec.Struct):
        return _record(obj)
    if isinstance(obj, enum.Enum) and type(obj).__module__.startswith("pstrain."):
        return obj.value  # a record's enum field (an update's kind); a user's enum is theirs
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _enc.pack(list(obj)))
    if isinstance(obj, np.generic):
        if obj.dtype.kind in _BUFFER_KINDS:
            # through an array: an empty np.str_ is dtype '<U0' with 4 bytes, its array '<U1'
            one = np.asarray(obj)
            return msgpack.ExtType(_EXT_SCALAR, msgpack.packb((one.dtype.str, one.tobytes())))
    elif type(obj) is int:
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    elif type(obj) in (bytearray, memoryview):
        return bytes(obj)
    if _enc.allow_pickle:
        return _pickle(obj)
    # Without pickles, subclasses of plain types travel as their base type.
    if isinstance(obj, tuple):
        return list(obj)
    for base in _PLAIN_TYPES:
        if isinstance(obj, base):
            return base(obj)
    raise InvalidArgumentError(
        f"cannot encode an object of type {type(obj).__name__} here "
        "(only numbers, strings, bytes, None, lists, tuples, dicts and numpy arrays)"
    )


def encode_body(obj: Any, *, allow_pickle: bool = False) -> list[bytes | memoryview]:
    """Encode ``obj`` into byte chunks to be written back to back.

    Arrays are referenced, not copied: keep them unchanged until the chunks
    are written.

    >>> import numpy as np
    >>> decode_body(b"".join(encode_body({"x": np.arange(3), "t": (1, [2])})))
    {'x': array([0, 1, 2]), 't': (1, [2])}
    """
    if isinstance(obj, msgspec.Struct):  # a record at the top: no round trip through _default
        obj = _record(obj)
    bufs: list[memoryview] = []
    _enc.buffers = bufs
    _enc.allow_pickle = allow_pickle
    try:
        header = _enc.pack(obj)
    finally:
        _enc.buffers = []
    n = len(bufs)
    prefix = _PREFIX.pack(len(header), n)
    lengths = struct.pack(f"<{n}Q", *(b.nbytes for b in bufs)) if n else b""
    head = prefix + lengths + header
    if not n:
        return [head]
    chunks: list[bytes | memoryview] = [head + b"\0" * _pad(len(head))]
    for buf in bufs:
        chunks.append(buf)
        pad = _pad(buf.nbytes)
        if pad:
            chunks.append(b"\0" * pad)
    return chunks


def encode(obj: Any, *, allow_pickle: bool = False) -> bytes:
    """:func:`encode_body` joined into one ``bytes`` (copies; for small messages and tests).

    >>> decode(encode((1, "a")))
    (1, 'a')
    """
    return b"".join(
        bytes(c) if isinstance(c, memoryview) else c for c in encode_body(obj, allow_pickle=allow_pickle)
    )


def decode(data: bytes | bytearray | memoryview, *, allow_pickle: bool = False) -> Any:
    """Same as :func:`decode_body`."""
    return decode_body(data, allow_pickle=allow_pickle)


def body_size(chunks: Sequence[bytes | memoryview]) -> int:
    """Total length in bytes of encoded chunks."""
    return sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)


def decode_body(
    body: bytes | bytearray | memoryview,
    *,
    allow_pickle: bool = False,
    imports: bool = True,
    pickle_failures_kept: bool = False,
) -> Any:
    """Decode a body made by :func:`encode_body`; arrays are views of ``body``.

    Raises :class:`ProtocolError` for a malformed or truncated body, and for
    pickled objects unless ``allow_pickle``. Without ``imports``, a pickle that would
    import a module raises :class:`ImportNeeded` (on a loop that answers health checks,
    an import of seconds must not run). With ``pickle_failures_kept``, a pickled object
    that cannot be rebuilt (its unpickling raises) is a :class:`PickleFailure` in its
    place, and the rest of the message decodes.
    """
    view = memoryview(body)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    total = view.nbytes
    if total < _PREFIX.size:
        raise ProtocolError(f"truncated message: {total} bytes is shorter than the 8-byte prefix")
    header_len, n = _PREFIX.unpack_from(view, 0)
    if n > MAX_BUFFERS:
        raise ProtocolError(f"malformed message: {n} buffers (limit {MAX_BUFFERS})")
    pos = _PREFIX.size
    if pos + 8 * n + header_len > total:
        raise ProtocolError(
            f"truncated message: header claims {header_len} bytes and {n} buffers, body has {total}"
        )
    lengths = struct.unpack_from(f"<{n}Q", view, pos) if n else ()
    pos += 8 * n
    header = view[pos : pos + header_len]
    pos += header_len
    buffers: list[memoryview] = []
    if n:
        pos += _pad(pos)
        for length in lengths:
            end = pos + length
            if end > total:
                raise ProtocolError(
                    f"truncated message: buffer of {length} bytes at offset {pos} runs past the "
                    f"end of a {total}-byte body"
                )
            buffers.append(view[pos:end])
            pos = end + _pad(length)

    try:
        return _Decoder(buffers, allow_pickle, imports, pickle_failures_kept).unpack(header)
    except (ProtocolError, InvalidArgumentError, ImportNeeded):
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed message header: {type(exc).__name__}: {exc}") from exc


class _Decoder:
    """The ext hook of one decode. A plain object, not nested closures: closures
    that refer to each other form a cycle that would keep the received body
    (possibly 64 MiB) alive until the cyclic GC happens to run."""

    __slots__ = ("buffers", "allow_pickle", "imports", "failures_kept", "depth")

    def __init__(
        self, buffers: list[memoryview], allow_pickle: bool, imports: bool, failures_kept: bool = False
    ) -> None:
        self.buffers = buffers
        self.allow_pickle = allow_pickle
        self.imports = imports
        self.failures_kept = failures_kept
        self.depth = 0

    def unpack(self, data: bytes | memoryview) -> Any:
        if self.depth >= MAX_DEPTH:
            raise ProtocolError(f"malformed message: tuples nested more than {MAX_DEPTH} deep")
        self.depth += 1
        try:
            return msgpack.unpackb(data, ext_hook=self, raw=False, strict_map_key=False, use_list=True)
        finally:
            self.depth -= 1

    def __call__(self, code: int, data: bytes) -> Any:
        if code == _EXT_ARRAY:
            return self._array(data)
        if code == _EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == _EXT_SCALAR:
            return self._scalar(data)
        if code == _EXT_BIGINT:
            return int(data)
        if code == _EXT_PICKLE:
            if not self.allow_pickle:
                raise ProtocolError("this endpoint does not accept pickled objects")
            import cloudpickle  # deferred: only peers that may execute code need it

            from .._formats.messages import pickling

            try:
                return cloudpickle.loads(data) if self.imports else pickling.loads_imported(data)
            except ImportNeeded:
                raise
            except ImportError as exc:  # a module the sender has and this task does not
                missing = InvalidArgumentError(
                    f"could not unpickle an object another task sent: {exc}. Its module "
                    "must be importable on every task (install it there, or put it on "
                    "PYTHONPATH); modules outside site-packages that a scheduled function or a "
                    "dataset_fn names are sent by value"
                )
                if self.failures_kept:
                    return PickleFailure(missing)
                raise missing from exc
            except Exception as exc:  # its own code raised (a __setstate__, a reduce function)
                if self.failures_kept:
                    return PickleFailure(exc)
                raise
        raise ProtocolError(f"malformed message: unknown ext type {code}")

    def _scalar(self, data: bytes) -> np.generic:
        # What the encoder sends: a dtype string of a kind that travels, and its bytes. Not a
        # structured dtype (a scalar that answers ``s["field"]``), nor a buffer of several.
        dtype_str, raw = msgpack.unpackb(data)
        if type(dtype_str) is not str or type(raw) is not bytes:
            raise ProtocolError("malformed scalar in message: expected a dtype string and bytes")
        dtype = np.dtype(dtype_str)
        if dtype.kind not in _BUFFER_KINDS or dtype.fields is not None or dtype.itemsize != len(raw):
            raise ProtocolError(f"malformed scalar in message: {len(raw)} bytes of dtype {dtype_str!r}")
        return np.frombuffer(raw, dtype=dtype)[0]

    def _array(self, data: bytes) -> np.ndarray:
        try:
            dtype_str, shape, index = msgpack.unpackb(data)
            dtype = np.dtype(dtype_str)
            if type(index) is not int or not 0 <= index < len(self.buffers):
                raise IndexError(f"buffer index {index!r} of {len(self.buffers)}")
            buf = self.buffers[index]
            count = 1
            for d in shape:
                count *= d
        except (TypeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"malformed array in message: {exc}") from exc
        if dtype.kind not in _BUFFER_KINDS or count * dtype.itemsize != buf.nbytes:
            raise ProtocolError(
                f"malformed array: shape {tuple(shape)} of {dtype} needs "
                f"{count * dtype.itemsize} bytes, buffer has {buf.nbytes}"
            )
        if count == 0:
            return np.empty(shape, dtype)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)
