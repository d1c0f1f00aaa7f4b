"""Datasets read from files: ``TextLineDataset``, TF's ``tf.data.TextLineDataset``.

Each line of each file is an element, as bytes without its line ending (``\\n`` or
``\\r\\n``), the files one after the other or, with ``num_parallel_reads``, interleaved a
line at a time as TF interleaves them. Files compressed with ``"GZIP"`` or ``"ZLIB"`` are
read as TF reads them. A file is opened when the iteration reaches it; one that is not
there is a :class:`~pstrain.errors.NotFoundError` then (TF's), naming it.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from .._base.checks import whole
from .._base.errors import InvalidArgumentError, NotFoundError
from .._base.exports import expose
from .data import AUTOTUNE, Dataset, TensorSpec

__all__ = ["TextLineDataset"]

#: The read buffer of a file when ``buffer_size`` is not given (TF's default: 256 KiB).
DEFAULT_BUFFER = 256 << 10

_COMPRESSIONS = (None, "", "GZIP", "ZLIB")


class TextLineDataset(Dataset):
    """The lines of ``filenames`` (a path, or a list, array or dataset of paths), as TF's
    ``tf.data.TextLineDataset``: each line an element of bytes (numpy's, as every string
    element here) without its ``\\n`` or ``\\r\\n``; an empty line is an empty element, a
    last line without a line ending an element too. ``compression_type`` is ``None`` (or
    ``""``), ``"GZIP"`` or ``"ZLIB"``; ``buffer_size`` the bytes read at a time;
    ``num_parallel_reads`` (or ``AUTOTUNE``: this machine's cores) files read side by side,
    their lines interleaved one at a time, in TF's order. ``name`` is TF's, accepted."""

    def __init__(
        self,
        filenames: Any,
        compression_type: str | None = None,
        buffer_size: int | None = None,
        num_parallel_reads: int | None = None,
        name: str | None = None,
    ) -> None:
        if compression_type not in _COMPRESSIONS:
            raise InvalidArgumentError(
                "TextLineDataset: compression_type must be None, '', 'GZIP' or 'ZLIB', "
                f"got {compression_type!r}"
            )
        buffer = (
            DEFAULT_BUFFER if buffer_size is None else whole(buffer_size, "TextLineDataset buffer_size", 1)
        )
        if num_parallel_reads == AUTOTUNE:
            num_parallel_reads = len(os.sched_getaffinity(0))
        parallel = 1 if num_parallel_reads is None else whole(num_parallel_reads, "num_parallel_reads", 1)
        names = filenames if isinstance(filenames, Dataset) else Dataset.from_tensor_slices(_paths(filenames))
        compression = compression_type or None

        def lines_of(path: Any) -> Dataset:
            return Dataset(lambda: _lines(_path(path), compression, buffer))

        files = names.interleave(lines_of, cycle_length=parallel, block_length=1)
        super().__init__(lambda: iter(files), spec=TensorSpec((), np.bytes_))


def _paths(filenames: Any) -> np.ndarray:
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
                f"TextLineDataset: filenames must be paths (str, bytes or os.PathLike), got {f!r}"
            )
    return np.array([os.fsdecode(f) for f in given], dtype=str)


def _path(value: Any) -> str:
    """A file name from a dataset of them (numpy's str or bytes)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise InvalidArgumentError(f"TextLineDataset: a file name must be a path, got {value!r}")
    return os.fsdecode(value)


def _lines(path: str, compression: str | None, buffer: int) -> Iterator[np.bytes_]:
    try:
        raw: BinaryIO = open(path, "rb")  # noqa: SIM115 - closed below (read ``buffer`` at a time)
    except FileNotFoundError:
        raise NotFoundError(f"TextLineDataset: {path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgumentError(f"TextLineDataset: {path} is a directory, not a file") from None
    with raw:
        if compression == "GZIP":
            yield from _split(_gzip_chunks(raw, path, buffer))
        elif compression == "ZLIB":
            yield from _split(_zlib_chunks(raw, path, buffer))
        else:
            yield from _split(iter(lambda: raw.read(buffer), b""))


def _gzip_chunks(raw: BinaryIO, path: str, buffer: int) -> Iterator[bytes]:
    with gzip.GzipFile(fileobj=raw) as f:
        try:
            yield from iter(lambda: f.read(buffer), b"")
        except (OSError, EOFError, zlib.error) as exc:
            raise InvalidArgumentError(f"TextLineDataset: {path} is not whole GZIP data ({exc})") from None


def _zlib_chunks(raw: BinaryIO, path: str, buffer: int) -> Iterator[bytes]:
    inflate = zlib.decompressobj()
    try:
        for chunk in iter(lambda: raw.read(buffer), b""):
            yield inflate.decompress(chunk)
        yield inflate.flush()
    except zlib.error as exc:
        raise InvalidArgumentError(f"TextLineDataset: {path} is not ZLIB data ({exc})") from None
    if not inflate.eof:
        raise InvalidArgumentError(f"TextLineDataset: {path} ends inside its ZLIB data")


def _split(chunks: Iterator[bytes]) -> Iterator[np.bytes_]:
    """Lines of a stream of chunks, without ``\n`` or ``\r\n``; a last line without a line
    ending too (nothing after a last ``\n``). A line longer than a chunk is joined once."""
    pending: list[bytes] = []  # the start of a line that did not end in its chunk
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line = chunk[start:end]
            if pending:
                line = b"".join([*pending, line])
                pending = []
            yield np.bytes_(line[:-1] if line.endswith(b"\r") else line)
            start = end + 1
        if start < len(chunk):
            pending.append(chunk[start:])
    if pending:
        line = b"".join(pending)
        yield np.bytes_(line[:-1] if line.endswith(b"\r") else line)


expose(globals(), "pstrain.data")
