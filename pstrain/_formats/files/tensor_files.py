"""Tensor files: safetensors written atomically through one descriptor (whole, or streamed
from a ps's store), and rows read back from any number of them into one array.

Files are opened once and never reopened by name (``open_directory``,
``write_atomically``): a path component swapped for a symlink meanwhile cannot redirect a
write. Headers are bounded (``MAX_HEADER``) before they are read. The checkpoint format
these files make up (the index, and which rows of which file) is ``checkpoint_files.py``.
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from ..._base.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, PstrainError
from ..._kernels import KERNELS
from .checksums import DIGEST_PREFIX, StreamDigests, Verifier, chunk_span, digest_entries, digests_of
from .direct_writes import DirectWriter

__all__ = [
    "MAX_HEADER",
    "SAFETENSORS_DTYPES",
    "TensorFile",
    "open_directory",
    "read_rows",
    "safetensors_header",
    "write_atomically",
    "write_streaming",
    "write_tensors",
]


def write_tensors(path: str, tensors: dict[str, np.ndarray]) -> int:
    """Write ``tensors`` to ``path`` atomically (temp file, fsync, rename); returns bytes."""
    from safetensors.numpy import save

    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    metadata = {DIGEST_PREFIX + k: digests_of(a.reshape(-1).view(np.uint8)) for k, a in arrays.items()}

    def write(f: BinaryIO) -> None:
        f.write(save(arrays, metadata=metadata))

    return write_atomically(path, write)


#: numpy dtype -> safetensors dtype tag (the format's own names).
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


def whole(key: str, arr: np.ndarray) -> tuple[str, np.dtype, tuple[int, ...], Any]:
    """``arr`` as one tensor of :func:`write_streaming` (its bytes in one piece)."""
    return key, arr.dtype, arr.shape, functools.partial(iter, (arr,))


def safetensors_header(
    tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, Any]]:
    """The head of a safetensors file holding ``tensors`` ``(key, dtype, shape)`` in that
    order, and its header: 8-byte length, then JSON (each tensor's dtype, shape and data
    offsets, and ``__metadata__``), space-padded to 8 bytes. Their bytes follow it."""
    header: dict[str, Any] = {}
    offset = 0
    for key, dtype, shape in tensors:
        tag = SAFETENSORS_DTYPES.get(np.dtype(dtype).name)
        if tag is None:
            raise InvalidArgumentError(
                f"checkpoint: {key!r} has dtype {dtype}, which safetensors cannot hold"
            )
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = {"__metadata__": metadata, **header} if metadata else header
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw, header


#: ``(key, dtype, shape, pieces)`` of each tensor :func:`write_streaming` writes.
StreamedTensors = Sequence[tuple[str, np.dtype, tuple[int, ...], Any]]


def write_streaming(
    path: str,
    tensors: StreamedTensors | Callable[[], StreamedTensors],
    root: str | None = None,
    write_s: float = 0.0,
    ahead: int = 0,
    sleep: Callable[[float], object] = time.sleep,
    chunk: int | None = None,
) -> int:
    """Write a safetensors file whose tensors arrive in pieces: ``(key, dtype, shape, pieces)``
    where ``pieces()`` yields the tensor's bytes in row order (so a large array need not be
    in memory twice), or ``pieces.write_to(writer)`` puts them into the writer's buffer
    itself (:meth:`~pstrain.server.ps.checkpoints.snapshots.Snapshot.write_to`: gathered there, not
    copied there after) and returns how many. The header is the format's (8-byte length,
    JSON with dtype, shape and data offsets, space-padded to 8 bytes); reading is
    safetensors' own. Written like :func:`write_atomically` with ``overwrite=False``, past
    the page cache (:mod:`~pstrain._formats.files.direct_writes`); returns the size. ``tensors``
    may be a function that makes them, called first (where the file is written: a delta's
    changed rows are found on the save thread, not where the save was asked for).
    ``write_s`` > 0: the file's bytes are spread over about that many seconds (no faster
    than its size / ``write_s``; a slower disk just takes longer), waiting with ``sleep``
    (one that returns early, ``Event.wait``, lets the rest go at full speed), after taking
    up to ``ahead`` of them into memory at once (:class:`DirectWriter`), ``chunk`` at a time
    (default ``CHUNK``; a ps under a memory budget stages less)."""
    if callable(tensors):
        tensors = tensors()
    sizes = [
        (key, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        for key, dtype, shape, _ in tensors
    ]
    raw, header = safetensors_header(
        [(key, dtype, shape) for key, dtype, shape, _ in tensors], digest_entries(sizes)
    )
    digests = StreamDigests(len(raw), sizes)

    def write(f: DirectWriter) -> None:
        f.observe = digests.feed
        f.write(raw)
        for key, dtype, _, pieces in tensors:
            want = header[key]["data_offsets"][1] - header[key]["data_offsets"][0]
            got = 0
            if hasattr(pieces, "write_to"):  # puts its bytes straight into f's buffer
                got = pieces.write_to(f)
            else:
                for piece in pieces():
                    data = np.ascontiguousarray(piece, dtype).reshape(-1)
                    f.write(data.view(np.uint8).data)
                    got += data.nbytes
            if got != want:
                raise InvalidArgumentError(f"checkpoint: {key!r} gave {got} bytes, not {want}")

    def checksums(f: DirectWriter) -> None:  # the data has gone out: its digests go in
        if not digests.done:
            raise InvalidArgumentError(
                f"checkpoint {path}: its tensors gave fewer bytes than their shapes (no checksum)"
            )
        for key, hexes in digests.digests.items():
            marker = (json.dumps(DIGEST_PREFIX + key) + ':"').encode()
            f.patch(raw.index(marker) + len(marker), hexes.encode())

    size = len(raw) + sum(h["data_offsets"][1] - h["data_offsets"][0] for h in header.values())
    if write_s <= 0 and any(hasattr(pieces, "tail_source") for *_, pieces in tensors):
        return write_atomically(
            path,
            functools.partial(_write_with_shared_tails, raw=raw, header=header, tensors=tensors),
            overwrite=False,
            root=root,
        )
    return write_atomically(
        path,
        write,
        overwrite=False,
        root=root,
        direct=True,
        rate=size / write_s if write_s > 0 else None,
        ahead=min(size, ahead),
        sleep=sleep,
        finished=checksums,
        chunk=chunk,
    )


#: Bytes a save through the page cache writes before it asks the kernel to start writing
#: them to disk (``posix_fadvise(DONTNEED)`` starts the writeback of a file's dirty pages
#: without waiting for it), so the disk works while the save reads the next rows, and the
#: fsync at the end has only the last of them to wait for.
WRITE_BEHIND = 8 << 20


def _write_with_shared_tails(f: Any, raw: bytes, header: dict[str, Any], tensors: StreamedTensors) -> None:
    """Write a file some of whose tensors end in parts that one shared source makes in one
    pass (``pieces.tail_source``, whose column ``pieces.tail_key`` is the tensor's tail: a
    tiered table's rows on disk, whose every column comes from the same records, read once
    for all of them instead of once per column). Each tensor's head
    (``pieces.head_blocks()``, or its pieces) is written at its place first, then the shared
    tails, a block of every column at a time, each at its own offset (``pwrite``, through
    the page cache: the columns' places are not aligned for ``O_DIRECT``). Each tensor's
    digests are taken from its bytes in order, as :func:`write_streaming` takes them."""
    fd = f.fileno()
    _pwrite_all(fd, raw, 0)
    at = {key: len(raw) + h["data_offsets"][0] for key, h in header.items()}
    sizes = {key: h["data_offsets"][1] - h["data_offsets"][0] for key, h in header.items()}
    digests = {key: StreamDigests(0, [(key, nbytes)]) for key, nbytes in sizes.items()}
    dtypes = {key: np.dtype(dtype) for key, dtype, _, _ in tensors}
    dirty = [0]  # bytes written since the disk was last asked to start writing them

    def put(key: str, piece: Any) -> None:
        data = np.ascontiguousarray(piece, dtypes[key]).reshape(-1).view(np.uint8)
        _pwrite_all(fd, data, at[key])
        digests[key].feed(data)
        at[key] += data.nbytes
        dirty[0] += data.nbytes
        if dirty[0] >= WRITE_BEHIND:  # the disk writes them while the next are read
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dirty[0] = 0

    shared: dict[int, tuple[Any, dict[str, str]]] = {}  # source -> {file key: its column}
    for key, _, _, pieces in tensors:
        source = getattr(pieces, "tail_source", None)
        if source is None:
            for piece in pieces.blocks() if hasattr(pieces, "blocks") else pieces():
                put(key, piece)
        else:
            for piece in pieces.head_blocks():
                put(key, piece)
            shared.setdefault(id(source), (source, {}))[1][key] = pieces.tail_key
    for source, keys in shared.values():
        for columns in source.tails(list(keys.values())):
            for key, column in keys.items():
                put(key, columns[column])
    for key, h in header.items():
        if at[key] != len(raw) + h["data_offsets"][1]:
            raise InvalidArgumentError(
                f"checkpoint: {key!r} gave {at[key] - len(raw) - h['data_offsets'][0]} bytes, "
                f"not {h['data_offsets'][1] - h['data_offsets'][0]}"
            )
    for key, d in digests.items():
        marker = (json.dumps(DIGEST_PREFIX + key) + ':"').encode()
        _pwrite_all(fd, d.digests[key].encode(), raw.index(marker) + len(marker))


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, "checkpoint write made no progress")
        view, offset = view[n:], offset + n


def open_directory(path: str, root: str | None = None) -> int:
    """A descriptor of directory ``path``. Under ``root`` (a ps's checkpoint root), each
    component below the root is opened relative to the one before with ``O_NOFOLLOW``:
    a symbolic link planted anywhere on the way is refused, never followed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    if root is None:
        return os.open(path or ".", flags)
    rel = os.path.relpath(path, root)
    if rel == os.curdir:
        return os.open(root, flags)
    if rel.startswith(os.pardir):
        raise InvalidArgumentError(f"{path} is outside the checkpoint root {root}")
    fd = os.open(root, flags)
    try:
        for part in rel.split(os.sep):
            try:
                nxt = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise InvalidArgumentError(
                    f"checkpoint directory {path}: {part!r} is not a directory under the root "
                    f"(a symbolic link is never followed): {exc.strerror}"
                ) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomically(
    path: str,
    write: Callable[[Any], object],
    *,
    overwrite: bool = True,
    root: str | None = None,
    mode: int = 0o644,
    direct: bool = False,
    rate: float | None = None,
    ahead: int = 0,
    sleep: Callable[[float], object] = time.sleep,
    finished: Callable[[DirectWriter], object] | None = None,
    chunk: int | None = None,
) -> int:
    """``write(f)`` into a new file, then give it the name ``path``: nobody ever sees a
    partial file, and no path is opened twice. Returns the file's size.

    The file is created exclusively (``O_EXCL | O_NOFOLLOW``, with ``mode``) under an unpredictable name
    relative to a descriptor of its directory (:func:`open_directory`), written and
    fsynced through its own descriptor, then renamed over ``path`` or, with
    ``overwrite=False``, linked to it (refused if ``path`` exists), and the directory is
    fsynced. Before answering, the name ``path`` is checked to be the file written (same
    inode): a file swapped in or taken away meanwhile is an error, never a silent success
    (nor an ``OSError`` of the race: a :class:`~pstrain.errors.PstrainError`). The temporary
    name is removed whatever happens. ``direct``: ``write`` is given a
    :class:`~pstrain._formats.files.direct_writes.DirectWriter` (past the page cache, no faster
    than ``rate`` bytes per second if given, waiting with ``sleep``, up to ``ahead`` bytes
    taken in first, ``chunk`` bytes at a time) instead of a file object, and
    ``finished(writer)`` is called once it has written every byte, before the file is
    fsynced (its header's checksums go in).
    """
    directory, base = os.path.split(path)
    dir_fd = open_directory(directory, root)
    tmp = f".{base}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd
        )
        try:
            if direct:
                writer = DirectWriter(fd, rate, ahead=ahead, chunk=chunk, sleep=sleep)
                write(writer)
                writer.finish()
                if finished is not None:
                    finished(writer)
            else:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    write(f)
            os.fsync(fd)
            mine = os.fstat(fd)
            try:
                if overwrite:
                    os.rename(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                else:
                    os.link(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                raise AlreadyExistsError(f"checkpoint file {path} already exists") from None
            except FileNotFoundError:  # its temporary name was taken away meanwhile
                raise PstrainError(
                    f"checkpoint file {path}: the file written was removed from "
                    "its folder during the save (the save failed)"
                ) from None
            there = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
            if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
                raise PstrainError(
                    f"checkpoint file {path} is not the file written: something "
                    "replaced it during the save (the save failed)"
                )
            os.fsync(dir_fd)
            return mine.st_size
        finally:
            os.close(fd)
    finally:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        os.close(dir_fd)


#: The largest safetensors header read (the format's own limit is 100 MB).
MAX_HEADER = 100 << 20
_DTYPE_OF_TAG = {tag: name for name, tag in SAFETENSORS_DTYPES.items()}


class _Tensor(NamedTuple):
    """A tensor of a safetensors file: where its bytes start, its dtype and shape, and its
    checksums (``checksums.py``; None in a file written before them)."""

    at: int
    dtype: np.dtype
    shape: tuple[int, ...]
    digests: str | None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def verifier(self, path: str, key: str, start: int = 0) -> Verifier | None:
        return None if self.digests is None else Verifier(path, key, self.digests, self.nbytes, start)


def _tensor_location(f: Any, path: str, key: str) -> _Tensor:
    """Where tensor ``key`` of the open safetensors file ``f`` starts, its dtype, shape and
    checksums, all checked against the file's size before anything is allocated."""
    found = _read_header(f, path).get(key)
    if found is None:
        raise InvalidArgumentError(f"cannot read {key!r} from {path}: no such tensor")
    return found


def _read_header(f: Any, path: str) -> dict[str, _Tensor]:
    """Every tensor of the open safetensors file ``f`` (read from its start): where its bytes
    start, its dtype, shape and checksums, each checked against the file's size."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) != 8:
        raise InvalidArgumentError(f"{path} is not a safetensors file (too short)")
    n = int.from_bytes(raw, "little")
    if n > min(MAX_HEADER, size - 8):
        raise InvalidArgumentError(f"{path}: its header claims {n} bytes; the file has {size}")
    try:
        header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise TypeError("not an object")
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"{path}: bad safetensors header ({exc!r})") from None
    tensors = {}
    metadata = header.get("__metadata__")
    metadata = metadata if isinstance(metadata, dict) else {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            tag, shape, (begin, end) = (
                meta["dtype"],
                tuple(int(d) for d in meta["shape"]),
                meta["data_offsets"],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"cannot read {key!r} from {path}: bad header ({exc!r})") from None
        if tag not in _DTYPE_OF_TAG:
            raise InvalidArgumentError(f"{key!r} in {path} has dtype {tag!r}")
        dtype = np.dtype(_DTYPE_OF_TAG[tag])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not (
            isinstance(begin, int)
            and isinstance(end, int)
            and 0 <= begin
            and end - begin == nbytes
            and 8 + n + end <= size
        ) or any(d < 0 for d in shape):
            raise InvalidArgumentError(
                f"{key!r} in {path}: its offsets do not match its shape and the file's size"
            )
        digests = metadata.get(DIGEST_PREFIX + key)
        tensors[key] = _Tensor(8 + n + begin, dtype, shape, digests if isinstance(digests, str) else None)
    # A file written with checksums has one for every tensor, and none for a tensor it does
    # not hold: one missing (or named wrong) is a damaged header, whose tensor would be read
    # unchecked as if written before checksums.
    named = {k[len(DIGEST_PREFIX) :] for k in metadata if isinstance(k, str) and k.startswith(DIGEST_PREFIX)}
    if named and (named != tensors.keys() or any(t.digests is None for t in tensors.values())):
        odd = sorted(named ^ tensors.keys()) or sorted(k for k, t in tensors.items() if t.digests is None)
        raise InvalidArgumentError(
            f"{path}: its header is damaged: the checksums name other tensors than it holds ({odd[:4]})"
        )
    return tensors


#: Bytes a :meth:`TensorFile.check` reads at a time.
CHECK_READ = 1 << 20


class TensorFile:
    """An open safetensors file, read through one descriptor: its header is read and every
    tensor's place checked against the file's size once, before anything is allocated.
    Held open, it stays readable after its name is removed (a save pruned meanwhile), and
    a link swapped in for its name later changes nothing. ``path`` must be resolved
    already (a ps confines it to its checkpoint root first): its last component is never
    followed if it is a symbolic link."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFoundError(f"checkpoint file {path} not found") from exc
        except OSError as exc:
            raise InvalidArgumentError(f"cannot open checkpoint file {path}: {exc.strerror}") from None
        self._f = os.fdopen(fd, "rb", buffering=0)
        self._checked: set[str] = set()  # tensors read through against their checksums
        self._alongside: set[str] = set()  # tensors checked by another thread meanwhile
        try:
            self.tensors = _read_header(self._f, path)
        except BaseException:
            self._f.close()
            raise

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def fileno(self) -> int:
        return self._f.fileno()

    def read(self, key: str) -> np.ndarray:
        """Tensor ``key`` whole, checked against its checksums."""
        tensor = self._locate(key)
        out = np.empty(tensor.shape, tensor.dtype)
        _read_into(self._f, tensor.at, out)
        _verify_whole(tensor, self.path, key, out)
        return out

    def check(self, key: str, step: int = CHECK_READ) -> None:
        """Read tensor ``key`` through, ``step`` bytes at a time, against its checksums
        (a reader that sends it while reading checks it first: damage is an error before
        anything is sent, not a reply cut short)."""
        tensor = self._locate(key)
        check = tensor.verifier(self.path, key)
        if check is None or key in self._checked:
            return
        # (a small buffer: many readers may check at once)
        buf = np.empty(min(step, tensor.nbytes), np.uint8)
        for lo in range(0, tensor.nbytes, step):
            piece = buf[: min(step, tensor.nbytes - lo)]
            _read_into(self._f, tensor.at + lo, piece)
            check.update(piece)
        check.finish()
        self._checked.add(key)  # the file is held open and never written: it stays so

    def checked_alongside(self, keys: Iterable[str]) -> None:
        """Tensors ``keys`` are read through against their checksums (:meth:`check`) on
        another thread meanwhile: reads of them (:meth:`iter_rows`) check nothing
        themselves. The caller trusts nothing read until that check has ended well."""
        self._alongside.update(keys)

    def _locate(self, key: str) -> _Tensor:
        found = self.tensors.get(key)
        if found is None:
            raise InvalidArgumentError(f"{self.path} has no tensor {key!r}")
        return found

    def iter_rows(self, key: str, keep: np.ndarray, dtype: np.dtype, piece_rows: int) -> Iterator[np.ndarray]:
        """The rows of 2-D tensor ``key`` where ``keep`` (bool, one per row) is true, in
        order, as ``dtype``: read ``piece_rows`` rows at a time into one reused buffer."""
        tensor = self._locate(key)
        at, saved, shape = tensor.at, tensor.dtype, tensor.shape
        if len(shape) != 2 or shape[0] != keep.size:
            raise InvalidArgumentError(f"{key!r} in {self.path} has shape {shape}, not ({keep.size}, dim)")
        row_bytes = shape[1] * saved.itemsize
        buf = np.empty((min(piece_rows, shape[0]), shape[1]), saved)
        # a tensor checked through (``check``, done or alongside) is not again; else every
        # piece is read, and each chunk checked as it goes
        checked = key in self._checked or key in self._alongside
        check = None if checked else tensor.verifier(self.path, key)
        for lo in range(0, shape[0], piece_rows):
            hi = min(lo + piece_rows, shape[0])
            mask = keep[lo:hi]
            if check is None and not mask.any():
                continue
            piece = buf[: hi - lo]
            _read_into(self._f, at + lo * row_bytes, piece)
            if check is not None:
                check.update(piece.reshape(-1).view(np.uint8))
            if mask.any():
                yield piece[mask].astype(dtype, copy=False)
        if check is not None:
            check.finish()


#: Bytes read at a time. The page cache's copy of each piece is let go as soon as it is read
#: (a restore reads gigabytes once): a 1.6 GB tensor read in one call took 3.8 s on the
#: benchmarks' VM, in 16 MiB pieces 1.3-2.0 s, and let go behind 0.95-0.99 s, as fast as a
#: plain read of the file into one reused buffer.
READ_CHUNK = 16 << 20
_FADVISE = getattr(os, "posix_fadvise", None)


def _read_into(f: Any, at: int, out: np.ndarray) -> None:
    """Fill ``out`` from file ``f`` at offset ``at`` (``f``'s own position is left alone)."""
    view = out.reshape(-1).view(np.uint8).data  # a view: out is C-contiguous
    fd = f.fileno()
    if _FADVISE is not None and len(view) > READ_CHUNK:
        _FADVISE(fd, at, len(view), os.POSIX_FADV_SEQUENTIAL)
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got : got + READ_CHUNK]], at + got)
        if not n:
            raise InvalidArgumentError(f"{f.name} ended early")
        if _FADVISE is not None:
            _FADVISE(fd, at + got, n, os.POSIX_FADV_DONTNEED)
        got += n


def read_rows(
    shape: tuple[int, ...], dtype: np.dtype, parts: list[list[Any]], patches: Sequence[Sequence[Any]] = ()
) -> np.ndarray:
    """Assemble an array from ``[file, key, src_start, src_stop, dst_start]`` row ranges,
    then put in each patch ``[file, rows key, idx key or None, shift]`` in order (a delta
    checkpoint's rows: row ``idx[i] + shift``, where it falls in the array, becomes
    ``rows[i]``; no idx key: the whole value).

    Reads go straight into the result (the header is parsed and checked here: safetensors'
    own reader copies out of a memory map, measured at about 60 % of a plain read); only
    the files' layout is safetensors'."""
    out = np.empty(shape, dtype)
    filled = 0
    for path, key, start, stop, dst in parts:
        try:
            with open(path, "rb", buffering=0) as f:
                tensor = _tensor_location(f, path, key)
                at, saved_dtype, saved_shape = tensor.at, tensor.dtype, tensor.shape
                if saved_dtype != dtype:
                    raise InvalidArgumentError(f"{key!r} in {path} is {saved_dtype}, expected {dtype}")
                if start is None:
                    if int(np.prod(saved_shape, dtype=np.int64)) != out.size or (
                        saved_shape != tuple(shape) and saved_shape != (1,)
                    ):
                        raise InvalidArgumentError(
                            f"{key!r} in {path} has shape {saved_shape}, expected {shape}"
                        )
                    _read_into(f, at, out)
                    _verify_whole(tensor, path, key, out)
                    filled = out.shape[0] if out.ndim else 1
                    continue
                if saved_shape[1:] != tuple(shape[1:]) or not 0 <= start < stop <= saved_shape[0]:
                    raise InvalidArgumentError(
                        f"rows {start}..{stop} of {key!r} in {path} (shape {saved_shape}) do not fit {shape}"
                    )
                row_bytes = math.prod(saved_shape[1:]) * dtype.itemsize
                _read_into(f, at + start * row_bytes, out[dst : dst + (stop - start)])
                _verify_range(
                    f, tensor, path, key, start * row_bytes, stop * row_bytes, out[dst : dst + (stop - start)]
                )
                filled += stop - start
        except FileNotFoundError as exc:
            raise NotFoundError(f"checkpoint file {path} not found") from exc
        except IsADirectoryError as exc:
            raise InvalidArgumentError(f"checkpoint file {path} is a directory") from exc
    expected = shape[0] if len(shape) else 1
    if filled != expected:
        raise InvalidArgumentError(f"checkpoint sources cover {filled} of {expected} rows")
    for path, rows_key, idx_key, shift in patches:
        _patch(out, path, rows_key, idx_key, int(shift))
    return out


def read_tensor(path: str, key: str) -> np.ndarray:
    """Tensor ``key`` of safetensors file ``path`` whole (its size checked against the file's
    before anything is allocated)."""
    try:
        with open(path, "rb", buffering=0) as f:
            tensor = _tensor_location(f, path, key)
            out = np.empty(tensor.shape, tensor.dtype)
            _read_into(f, tensor.at, out)
            _verify_whole(tensor, path, key, out)
            return out
    except FileNotFoundError as exc:
        raise NotFoundError(f"checkpoint file {path} not found") from exc


def _verify_whole(tensor: _Tensor, path: str, key: str, out: np.ndarray) -> None:
    """``out`` holds all of ``tensor``: each chunk matches its checksum."""
    check = tensor.verifier(path, key)
    if check is not None:
        check.update(out.reshape(-1).view(np.uint8))
        check.finish()


def _verify_range(f: Any, tensor: _Tensor, path: str, key: str, lo: int, hi: int, got: np.ndarray) -> None:
    """``got`` holds bytes ``[lo, hi)`` of ``tensor``: they, with the rest of the chunks
    they fall in (read here, at most a chunk on each side), match their checksums."""
    if tensor.digests is None or hi <= lo:
        return
    first, last = chunk_span(lo, hi, tensor.nbytes)
    check = tensor.verifier(path, key, first)
    assert check is not None
    before = np.empty(lo - first, np.uint8)
    after = np.empty(last - hi, np.uint8)
    _read_into(f, tensor.at + first, before)
    _read_into(f, tensor.at + hi, after)
    for part in (before, got.reshape(-1).view(np.uint8), after):
        check.update(part)
    check.finish()


#: Rows of a delta read and put in at once (a bounded buffer, not the delta's whole tensor).
PATCH_ROWS = 1 << 16


def _patch(out: np.ndarray, path: str, rows_key: str, idx_key: str | None, shift: int) -> None:
    if idx_key is None:
        rows = read_tensor(path, rows_key)
        if rows.dtype != out.dtype:
            raise InvalidArgumentError(f"{rows_key!r} in {path} is {rows.dtype}, expected {out.dtype}")
        if rows.size != out.size:
            raise InvalidArgumentError(f"{rows_key!r} in {path} has shape {rows.shape}, expected {out.shape}")
        out[...] = rows.reshape(out.shape)
        return
    try:
        with open(path, "rb", buffering=0) as f:  # once for both tensors
            tensor = _tensor_location(f, path, idx_key)
            idx = np.empty(tensor.shape, tensor.dtype)
            _read_into(f, tensor.at, idx)
            _verify_whole(tensor, path, idx_key, idx)
            f.seek(0)
            tensor = _tensor_location(f, path, rows_key)
            at, dtype, shape = tensor.at, tensor.dtype, tensor.shape
            check = tensor.verifier(path, rows_key)
            if dtype != out.dtype:
                raise InvalidArgumentError(f"{rows_key!r} in {path} is {dtype}, expected {out.dtype}")
            if idx.dtype != np.int64 or idx.ndim != 1 or not out.ndim or shape != (idx.size, *out.shape[1:]):
                raise InvalidArgumentError(
                    f"{idx_key!r} and {rows_key!r} in {path} ({idx.dtype} "
                    f"{idx.shape}, {shape}) are not rows of {out.shape}"
                )
            dst = idx + shift
            dst[(dst < 0) | (dst >= out.shape[0])] = -1  # rows of another part: skipped
            flat = out.reshape(out.shape[0], -1)  # a view: out is C-contiguous
            compiled = out.dtype in (np.float32, np.float64) and flat.shape[1] > 0
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            buf = np.empty((min(PATCH_ROWS, idx.size), *out.shape[1:]), dtype)
            for lo in range(0, idx.size, PATCH_ROWS):  # bounded pieces, each put in as read
                hi = min(lo + PATCH_ROWS, idx.size)
                piece = buf[: hi - lo]
                _read_into(f, at + lo * row_bytes, piece)
                if check is not None:
                    check.update(piece.reshape(-1).view(np.uint8))
                if compiled:  # one C loop without the GIL: twice numpy's scatter, measured
                    KERNELS.put_rows(flat, dst[lo:hi], piece.reshape(piece.shape[0], -1))
                else:
                    keep = dst[lo:hi] >= 0
                    out[dst[lo:hi][keep]] = piece[keep]
            if check is not None:
                check.finish()
    except FileNotFoundError as exc:
        raise NotFoundError(f"checkpoint file {path} not found") from exc
