"""Datasets read from files, as TF reads them: ``TextLineDataset`` (each line an element)
and ``TFRecordDataset`` (each record an element: the files TF's ``TFRecordWriter`` writes,
most often ``tf.train.Example``\\ s, which :func:`pstrain.data.parse_example` reads).

Files are read one after the other or, with ``num_parallel_reads``, side by side, an
element of each in turn, as TF interleaves them. Files compressed with ``"GZIP"`` or
``"ZLIB"`` are read as TF reads them. A file is opened when the iteration reaches it; one
that is not there is a :class:`~pstrain.errors.NotFoundError` then (TF's), naming it. A
record whose checksum does not match, or that the file ends inside, is a
:class:`~pstrain.errors.DataLossError` naming the file and where the record starts, as TF
reports it: never a record passed on damaged.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Protocol

import numpy as np

from .._base.checks import whole
from .._base.errors import DataLossError, InvalidArgumentError, NotFoundError
from .._base.exports import expose
from .._kernels import KERNELS
from .data import AUTOTUNE, Dataset, TensorSpec

__all__ = ["TFRecordDataset", "TFRecordWriter", "TextLineDataset"]

#: The bytes read at a time when ``buffer_size`` is not given (TF's default: 256 KiB).
DEFAULT_BUFFER = 256 << 10

_COMPRESSIONS = (None, "", "GZIP", "ZLIB")


class _Stream(Protocol):
    """What a file's elements are read from: the file, or its data inflated."""

    def read(self, n: int, /) -> bytes: ...


class _FileDataset(Dataset):
    """The elements :meth:`_elements` gives of each of ``filenames``, with TF's arguments of
    its file datasets (the subclasses' docstrings say them)."""

    kind = ""
    #: Each element of one file (its stream, its name, the bytes to read at a time).
    _elements: Callable[[_Stream, str, int], Iterator[bytes]]

    def __init__(
        self,
        filenames: Any,
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        name: str | None = None,
    ) -> None:
        kind = self.kind
        if compression_type not in _COMPRESSIONS:
            raise InvalidArgumentError(
                f"{kind}: compression_type must be None, '', 'GZIP' or 'ZLIB', got {compression_type!r}"
            )
        buffer = DEFAULT_BUFFER if buffer_size is None else whole(buffer_size, f"{kind} buffer_size", 1)
        if num_parallel_reads == AUTOTUNE:
            num_parallel_reads = len(os.sched_getaffinity(0))
        parallel = 1 if num_parallel_reads is None else whole(num_parallel_reads, "num_parallel_reads", 1)
        names = (
            filenames
            if isinstance(filenames, Dataset)
            else Dataset.from_tensor_slices(_paths(filenames, kind))
        )
        compression, read = compression_type or None, self._elements

        def elements_of(path: Any) -> Dataset:
            return Dataset(lambda: _read(_path(path, kind), compression, buffer, read, kind))

        files = names.interleave(elements_of, cycle_length=parallel, block_length=1)
        super().__init__(lambda: iter(files), spec=TensorSpec((), object))


class TextLineDataset(_FileDataset):
    """The lines of ``filenames`` (a path, or a list, array or dataset of paths), as TF's
    ``tf.data.TextLineDataset``: each line an element of bytes without its ``\\n`` and
    without any ``\\r`` (TF's reader drops every one of a line, not only one before the
    ``\\n``; a batch of lines is an array of objects, as TF's numpy values are); an empty
    line is an empty element, a last line without a line ending an element too.
    ``compression_type`` is ``None`` (or ``""``), ``"GZIP"`` or ``"ZLIB"``; ``buffer_size``
    the bytes read at a time; ``num_parallel_reads`` (or ``AUTOTUNE``: this machine's cores)
    files read side by side, their lines interleaved one at a time, in TF's order. ``name``
    is TF's, accepted."""

    kind = "TextLineDataset"

    @staticmethod
    def _elements(f: _Stream, path: str, buffer: int) -> Iterator[bytes]:
        return _split(iter(lambda: f.read(buffer), b""))


class TFRecordDataset(_FileDataset):
    """The records of ``filenames`` (TFRecord files, as TF's ``TFRecordWriter`` writes
    them), as TF's ``tf.data.TFRecordDataset``: each record an element of bytes, its length
    and its data checked against their CRC-32C checksums. ``compression_type``,
    ``buffer_size`` and ``num_parallel_reads`` as :class:`TextLineDataset`'s; ``name`` is
    TF's, accepted. A file that ends inside a record's header ends quietly, as in TF; one
    that ends inside its data, or a checksum that does not match, is a
    :class:`~pstrain.errors.DataLossError`."""

    kind = "TFRecordDataset"

    @staticmethod
    def _elements(f: _Stream, path: str, buffer: int) -> Iterator[bytes]:
        return _records(f, path, buffer)


class TFRecordWriter:
    """TF's ``tf.io.TFRecordWriter``: records written to ``path`` in TFRecord framing (each
    record's length and data with their masked CRC-32C), the bytes TF writes for them;
    ``options`` is ``None``, ``""``, ``"GZIP"`` or ``"ZLIB"`` (or TF's ``TFRecordOptions``:
    its ``compression_type``). A context manager; :meth:`close` ends the file."""

    def __init__(self, path: str | os.PathLike[str], options: Any = None) -> None:
        compression = getattr(options, "compression_type", options) or None
        if compression not in _COMPRESSIONS:
            raise InvalidArgumentError(
                f"TFRecordWriter: options must be None, '', 'GZIP' or 'ZLIB', got {options!r}"
            )
        self.path = os.fspath(path)
        self._file: Any = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._deflate = zlib.compressobj() if compression == "ZLIB" else None
        if compression == "GZIP":
            self._file = gzip.GzipFile(fileobj=self._file, mode="wb")
        self._raw: BinaryIO | None = None if compression != "GZIP" else self._file.fileobj

    def write(self, record: bytes) -> None:
        """Add one record (bytes)."""
        if self._file is None:
            raise InvalidArgumentError(f"TFRecordWriter: {self.path} is closed")
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"TFRecordWriter: a record must be bytes, got {type(record).__name__}")
        data = bytes(record)
        length = len(data).to_bytes(8, "little")
        framed = b"".join((length, _masked_crc(length), data, _masked_crc(data)))
        self._file.write(self._deflate.compress(framed) if self._deflate is not None else framed)

    def flush(self) -> None:
        """Hand what was written to the operating system (a compressed stream's pending
        bytes stay until :meth:`close`)."""
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        """End the file (its compressed stream too); closing again does nothing."""
        if self._file is None:
            return
        if self._deflate is not None:
            self._file.write(self._deflate.flush())
        self._file.close()
        if self._raw is not None:  # (GzipFile leaves the file it wrote into open)
            self._raw.close()
        self._file = None

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _masked_crc(data: bytes) -> bytes:
    """TFRecord's masked CRC-32C of ``data``, as its 4 bytes."""
    crc = KERNELS.crc32c(np.frombuffer(data, np.uint8))
    return ((((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF).to_bytes(4, "little")


def _paths(filenames: Any, kind: str) -> np.ndarray:
    """The file names given, as a 1-D array of str (a path alone is a list of one)."""
    if isinstance(filenames, (str, bytes, os.PathLike)):
        filenames = [filenames]
    try:
        given = list(np.asarray(filenames, dtype=object).reshape(-1))
    except (TypeError, ValueError):
        given = [filenames]
    for f in given:
        if not isinstance(f, (str, bytes, os.PathLike)):
            raise InvalidArgumentError(
                f"{kind}: filenames must be paths (str, bytes or os.PathLike), got {f!r}"
            )
    return np.array([os.fsdecode(f) for f in given], dtype=str)


def _path(value: Any, kind: str) -> str:
    """A file name from a dataset of them (numpy's str or bytes)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(f"{kind}: a file name must be a path, got {value!r}")
    return os.fsdecode(value)


def _read(
    path: str,
    compression: str | None,
    buffer: int,
    read: Callable[[_Stream, str, int], Iterator[bytes]],
    kind: str,
) -> Iterator[bytes]:
    """``read``'s elements of file ``path``, decompressed as ``compression`` says."""
    try:
        raw: BinaryIO = open(path, "rb", buffering=max(buffer, 2))  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise NotFoundError(f"{kind}: {path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"{kind}: {path} is a directory, not a file") from None
    with raw:
        if compression is None:
            yield from read(raw, path, buffer)
            return
        yield from read(_Inflated(raw, buffer, compression, path, kind), path, buffer)


class _Inflated:
    """A GZIP or ZLIB stream read as a file (``read(n)``), as TF's ``ZlibInputStream``
    reads ``compression_type`` "GZIP" and "ZLIB": what is inflated comes as it comes, so the
    elements before damage are read; GZIP members one after another. Data that is not of
    the format, bytes after a ZLIB stream, or a file that ends inside a member is a
    ``DataLossError`` naming the file once what came before it is read (TF ends quietly on
    the last two)."""

    def __init__(self, raw: BinaryIO, buffer: int, compression: str, path: str, kind: str) -> None:
        self.raw, self.buffer, self.path, self.kind = raw, buffer, path, kind
        self.compression = compression
        self.wbits = 16 + zlib.MAX_WBITS if compression == "GZIP" else zlib.MAX_WBITS
        self.inflate = zlib.decompressobj(self.wbits)
        self.pending = b""
        self.started = False  # a member has begun: its end, not the file's, is due
        self.failure: DataLossError | None = None  # raised once ``pending`` is read

    def read(self, n: int) -> bytes:
        while len(self.pending) < n and self.failure is None:
            want = n - len(self.pending)  # (never more: a small file may inflate to a huge one)
            if self.inflate.unconsumed_tail:
                self._inflate(self.inflate.unconsumed_tail, want)
                continue
            if self.inflate.eof:  # a member ended: GZIP's next may follow
                rest = self.inflate.unused_data or self.raw.read(self.buffer)
                if not rest:
                    break
                if self.compression != "GZIP":
                    self.failure = self._lost("has bytes after its ZLIB stream")
                    break
                self.inflate, self.started = zlib.decompressobj(self.wbits), False
                self._inflate(rest, want)
                continue
            chunk = self.raw.read(self.buffer)
            if not chunk:
                if self.started:
                    self.failure = self._lost(f"ends inside its {self.compression} data")
                break
            self._inflate(chunk, want)
        if not self.pending and self.failure is not None:
            raise self.failure
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def _inflate(self, data: bytes, most: int) -> None:
        self.started = True
        try:
            self.pending += self.inflate.decompress(data, most)
        except zlib.error as exc:
            self.failure = self._lost(f"is not whole {self.compression} data ({exc})")

    def _lost(self, what: str) -> DataLossError:
        return DataLossError(f"{self.kind}: {self.path} {what}")


def _split(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines of a stream of chunks, without ``\\n`` and without any ``\\r`` (as TF's
    ``BufferedInputStream::ReadLine``); a last line without a line ending too, unless it is
    empty then. A line longer than a chunk is joined once."""
    pending: list[bytes] = []  # the start of a line that did not end in its chunk
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line = chunk[start:end]
            if pending:
                line = b"".join([*pending, line])
                pending = []
            yield line.replace(b"\r", b"")
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    last = b"".join(pending).replace(b"\r", b"")
    if last:  # (a last line of nothing but \r is no line, as in TF)
        yield last


#: A record's header: its length (8 bytes), then the masked CRC-32C of those 8 bytes.
_HEADER_BYTES = 12


def _records(f: _Stream, path: str, buffer: int) -> Iterator[bytes]:
    """The records of one TFRecord stream, each checked (``tfrecord_split``, compiled), read
    ``buffer`` bytes at a time, or at once for the rest of a record longer than that; where
    each starts is counted for the errors."""
    pending, offset = b"", 0  # bytes read and not yet taken, and where they start in the file
    while True:
        chunk = f.read(buffer)
        data = pending + chunk if pending else chunk
        records, used, problem, at, need = KERNELS.tfrecord_split(np.frombuffer(data, np.uint8))
        yield from records
        if problem:
            what = "its length's checksum" if problem == 1 else "its data's checksum"
            raise DataLossError(f"TFRecordDataset: {path}: corrupted record at {offset + at} ({what})")
        pending, offset = data[used:], offset + used
        if need > buffer:  # a long record: the rest of it in one go (as much as the file has)
            pending += _read_exactly(f, need)
        if not chunk:
            if len(pending) >= _HEADER_BYTES:  # (fewer: the end, inside a header, as TF ends)
                raise DataLossError(f"TFRecordDataset: {path}: truncated record at {offset}")
            return


def _read_exactly(f: _Stream, n: int) -> bytes:
    """``n`` bytes, or fewer where the file ends; read as they arrive, so that a length a
    damaged header claims costs only what the file holds."""
    parts, left = [], n
    while left:
        part = f.read(min(left, 1 << 24))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


expose(globals(), "pstrain.data")
