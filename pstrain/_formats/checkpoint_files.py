"""The checkpoint file format, written by the ps and the coordinator, read by both.

A checkpoint ``<prefix>`` is

* ``<prefix>.ps<K>.safetensors``: the parts ps K holds, written by that ps
  (``<prefix>.local.safetensors`` for variables local to the coordinator);
* ``<prefix>.index.json``: written last, atomically, by the coordinator: for
  each logical variable, keyed by its object-graph path (``model/dense/kernel``,
  see ``object_graph.py``), its dtype, shape, the name it had, and the row
  ranges of its parts (``{"file", "key", "offset", "rows"}``). A checkpoint
  without its index does not exist.

Format version 2 keys variables by path. Version 1 (pstrain before object-graph
checkpoints) keyed them by variable name; :class:`CheckpointReader` reads both
and says which (``keyed_by``), and ``Checkpoint.restore`` refuses version 1
(names are not stable; see its message).

A reader asks for rows ``[start, stop)`` of a variable and gets *sources*
(``[file, key, src_start, src_stop, dst_start]``) that :func:`read_rows`
assembles, so a variable saved in 4 parts restores into 2, or into 1.
No network here; file I/O only.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable, Sequence
from typing import Annotated, Any, BinaryIO

import msgspec
import numpy as np

from .._base.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, PstrainError

__all__ = ["FORMAT", "INDEX", "CheckpointReader", "index_path", "read_index", "read_rows", "sources",
           "write_atomically", "write_index", "write_tensors"]

FORMAT = "pstrain-checkpoint"
VERSION = 2
INDEX = ".index.json"

#: A part file's name: a plain file name in the checkpoint's own directory.
FileName = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[^/\\\x00]+$")]


class _Part(msgspec.Struct, forbid_unknown_fields=True):
    file: FileName
    key: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    rows: Annotated[int, msgspec.Meta(ge=0)]


class _Variable(msgspec.Struct, forbid_unknown_fields=True):
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    parts: Annotated[list[_Part], msgspec.Meta(min_length=1)]
    trainable: bool = True
    name: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class _Table(msgspec.Struct, forbid_unknown_fields=True):
    """A dynamic table: its configuration and one file per ps shard (ids, rows, slots)."""

    name: Annotated[str, msgspec.Meta(max_length=1024)]
    dim: Annotated[int, msgspec.Meta(ge=1)]
    dtype: str
    config: dict[str, Any]
    files: list[Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]]
    rows: Annotated[int, msgspec.Meta(ge=0)] = 0


class _Index(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    version: int
    variables: dict[str, _Variable]
    save_counter: Annotated[int, msgspec.Meta(ge=0)] = 0
    tables: dict[str, _Table] = {}


def _file_size(base: str, file: str, sizes: dict[str, int]) -> int:
    if file not in sizes:
        try:
            sizes[file] = os.stat(os.path.join(base, file)).st_size
        except OSError:
            sizes[file] = 0  # a missing part holds nothing: its variable is refused
    return sizes[file]


def _check_index(path: str, raw: Any) -> dict[str, Any]:
    """The index, checked whole: schema, file names, dtypes, shapes against the bytes their
    files hold, parts disjoint and covering."""
    try:
        index = msgspec.convert(raw, _Index)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"checkpoint index {path} is malformed: {exc}") from None
    base = os.path.dirname(path)
    sizes: dict[str, int] = {}
    if index.format != FORMAT or index.version not in (1, VERSION):
        raise InvalidArgumentError(f"{path} is not a pstrain checkpoint (format {index.format!r}, "
                                   f"version {index.version})")
    for name, var in index.variables.items():
        try:
            dtype = np.dtype(var.dtype)
        except TypeError:
            raise InvalidArgumentError(f"checkpoint index {path}: {name!r} has bad dtype "
                                       f"{var.dtype!r}") from None
        if dtype.kind not in "biufc":
            raise InvalidArgumentError(f"checkpoint index {path}: {name!r} has dtype {dtype}")
        if any(p.file in (".", "..") for p in var.parts):
            raise InvalidArgumentError(f"checkpoint index {path}: {name!r} names a bad file")
        if any(d < 0 for d in var.shape):
            raise InvalidArgumentError(f"checkpoint index {path}: {name!r} has shape {var.shape}")
        # A value can be no larger than the files that hold it: checked before anything is
        # allocated for it (an index claiming [2**40, 2**40] is refused here, not crashed on).
        nbytes = math.prod(var.shape) * dtype.itemsize
        on_disk = sum(_file_size(base, f, sizes) for f in {p.file for p in var.parts})
        if nbytes > on_disk:
            raise InvalidArgumentError(
                f"checkpoint index {path}: {name!r} claims {var.shape} {dtype} ({nbytes} bytes), "
                f"more than its files hold ({on_disk} bytes)")
        rows = var.shape[0] if var.shape else 1
        pos = 0
        for p in sorted(var.parts, key=lambda p: p.offset):
            if p.offset != pos:
                raise InvalidArgumentError(f"checkpoint index {path}: the parts of {name!r} "
                                           f"{'overlap' if p.offset < pos else 'leave a gap'} at row {pos}")
            pos += p.rows
        if pos != rows:
            raise InvalidArgumentError(f"checkpoint index {path}: the parts of {name!r} cover "
                                       f"{pos} of its {rows} rows")
    for name, table in index.tables.items():
        if any(os.path.basename(f) != f or f in (".", "..") for f in table.files):
            raise InvalidArgumentError(f"checkpoint index {path}: table {name!r} names a bad file")
        try:
            if np.dtype(table.dtype).kind != "f":
                raise TypeError
        except TypeError:
            raise InvalidArgumentError(f"checkpoint index {path}: table {name!r} has dtype "
                                       f"{table.dtype!r}") from None
    return msgspec.to_builtins(index)


def index_path(path: str) -> str:
    """The index file of checkpoint ``path`` (a prefix, or the index itself).

    >>> index_path("/tmp/run/ckpt-3")
    '/tmp/run/ckpt-3.index.json'
    """
    return path if path.endswith(INDEX) else path + INDEX


def checkpoint_dir(path: str) -> str:
    """The directory that holds checkpoint ``path``'s files."""
    return os.path.dirname(os.path.abspath(index_path(path)))


def read_index(path: str) -> dict[str, Any]:
    """The manifest of checkpoint ``path`` (the prefix ``save`` returned)."""
    try:
        with open(index_path(path), encoding="utf-8") as f:
            index = json.load(f)
    except FileNotFoundError as exc:
        raise NotFoundError(f"no checkpoint at {path} (missing {index_path(path)})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"checkpoint index {index_path(path)} is damaged: {exc}") from exc
    return _check_index(index_path(path), index)


def write_index(prefix: str, variables: dict[str, Any], save_counter: int = 0,
                tables: dict[str, Any] | None = None) -> None:
    """Write the index of checkpoint ``prefix`` atomically (temp file, fsync, rename)."""
    path = index_path(prefix)

    def write(f: BinaryIO) -> None:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "save_counter": save_counter,
                            "variables": variables, **({"tables": tables} if tables else {})},
                           indent=1).encode())

    write_atomically(path, write)


def sources(saved: dict[str, Any], base: str, start: int, stop: int, scalar: bool) -> list[list[Any]]:
    """Row ranges of the saved parts of one variable that cover its rows ``[start, stop)``."""
    parts = saved["parts"]
    whole = len(parts) == 1 and (scalar or (parts[0]["offset"] == start and parts[0]["rows"] == stop - start))
    if whole:
        return [[os.path.join(base, parts[0]["file"]), parts[0]["key"], None, None, None]]
    out = []
    for p in parts:
        lo, hi = max(start, p["offset"]), min(stop, p["offset"] + p["rows"])
        if lo < hi:
            out.append([os.path.join(base, p["file"]), p["key"], lo - p["offset"], hi - p["offset"], lo - start])
    return out


class CheckpointReader:
    """One checkpoint: its index read and checked once, its variables read when asked."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = read_index(path)
        self.base = checkpoint_dir(path)

    @property
    def keyed_by(self) -> str:
        """``"path"`` (format 2, object graph) or ``"name"`` (format 1)."""
        return "path" if self.index["version"] >= 2 else "name"

    @property
    def save_counter(self) -> int:
        return int(self.index.get("save_counter", 0))

    @property
    def variables(self) -> dict[str, Any]:
        """The index's entry of each variable, by path (by name in format 1)."""
        variables: dict[str, Any] = self.index["variables"]
        return variables

    @property
    def tables(self) -> dict[str, Any]:
        """The index's entry of each dynamic table, by path."""
        tables: dict[str, Any] = self.index.get("tables", {})
        return tables

    def read_table(self, path: str) -> dict[str, np.ndarray]:
        """A saved dynamic table whole: ``ids`` (ascending), ``rows`` and ``slot:<key>`` arrays."""
        from safetensors import safe_open

        meta = self.tables[path]
        parts: dict[str, list[np.ndarray]] = {}
        for file in meta["files"]:
            with safe_open(os.path.join(self.base, file), "np") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not key.startswith("init:"):
                        parts.setdefault(key, []).append(f.get_tensor(key))
        out = {k: np.concatenate(v) for k, v in parts.items()}
        live = out.pop("live", None)
        if live is not None:  # rows handed out and evicted since are not the table's
            out = {k: v[live] for k, v in out.items()}
        order = np.argsort(out["ids"], kind="stable")
        return {k: v[order] for k, v in out.items()}

    def read(self, name: str) -> np.ndarray | None:
        """Variable ``name`` as a full array (None if the checkpoint does not have it)."""
        meta = self.variables.get(name)
        if meta is None:
            return None
        shape = tuple(meta["shape"])
        return read_rows(shape, np.dtype(meta["dtype"]),
                         sources(meta, self.base, 0, shape[0] if shape else 1, not shape))


def write_tensors(path: str, tensors: dict[str, np.ndarray]) -> int:
    """Write ``tensors`` to ``path`` atomically (temp file, fsync, rename); returns bytes."""
    from safetensors.numpy import save

    def write(f: BinaryIO) -> None:
        f.write(save({k: np.ascontiguousarray(v) for k, v in tensors.items()}))

    return write_atomically(path, write)


#: numpy dtype -> safetensors dtype tag (the format's own names).
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
                      "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}


def write_streaming(path: str, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...], Any]],
                    root: str | None = None) -> int:
    """Write a safetensors file whose tensors arrive in pieces: ``(key, dtype, shape,
    pieces)`` where ``pieces()`` yields the tensor's bytes in row order (so a large array
    need not be in memory twice). The header is the format's (8-byte length, JSON with
    dtype, shape and data offsets, space-padded to 8 bytes); reading is safetensors' own.
    Written like :func:`write_atomically` with ``overwrite=False``; returns the size."""
    header: dict[str, Any] = {}
    offset = 0
    for key, dtype, shape, _ in tensors:
        tag = SAFETENSORS_DTYPES.get(np.dtype(dtype).name)
        if tag is None:
            raise InvalidArgumentError(f"checkpoint: {key!r} has dtype {dtype}, which safetensors "
                                       "cannot hold")
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[key] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)

    def write(f: BinaryIO) -> None:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for key, dtype, _, pieces in tensors:
            want = header[key]["data_offsets"][1] - header[key]["data_offsets"][0]
            got = 0
            for piece in pieces():
                data = np.ascontiguousarray(piece, dtype).reshape(-1)
                f.write(data.view(np.uint8).data)
                got += data.nbytes
            if got != want:
                raise InvalidArgumentError(f"checkpoint: {key!r} gave {got} bytes, not {want}")

    return write_atomically(path, write, overwrite=False, root=root)


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
                    f"(a symbolic link is never followed): {exc.strerror}") from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomically(path: str, write: Callable[[BinaryIO], None], *, overwrite: bool = True,
                     root: str | None = None) -> int:
    """``write(f)`` into a new file, then give it the name ``path``: nobody ever sees a
    partial file, and no path is opened twice. Returns the file's size.

    The file is created exclusively (``O_EXCL | O_NOFOLLOW``) under an unpredictable name
    relative to a descriptor of its directory (:func:`open_directory`), written and
    fsynced through its own descriptor, then renamed over ``path`` or, with
    ``overwrite=False``, linked to it (refused if ``path`` exists), and the directory is
    fsynced. Before answering, the name ``path`` is checked to be the file written (same
    inode): a file swapped in meanwhile is an error, never a silent success. The temporary
    name is removed whatever happens.
    """
    directory, base = os.path.split(path)
    dir_fd = open_directory(directory, root)
    tmp = f".{base}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                write(f)
            os.fsync(fd)
            mine = os.fstat(fd)
            if overwrite:
                os.rename(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            else:
                try:
                    os.link(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                except FileExistsError:
                    raise AlreadyExistsError(f"checkpoint file {path} already exists") from None
            there = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
            if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
                raise PstrainError(f"checkpoint file {path} is not the file written: something "
                                   "replaced it during the save (the save failed)")
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


def _tensor_location(f: Any, path: str, key: str) -> tuple[int, np.dtype, tuple[int, ...]]:
    """Where tensor ``key`` of the open safetensors file ``f`` starts, its dtype and shape,
    all checked against the file's size before anything is allocated."""
    size = os.fstat(f.fileno()).st_size
    raw = f.read(8)
    if len(raw) != 8:
        raise InvalidArgumentError(f"{path} is not a safetensors file (too short)")
    n = int.from_bytes(raw, "little")
    if n > min(MAX_HEADER, size - 8):
        raise InvalidArgumentError(f"{path}: its header claims {n} bytes; the file has {size}")
    try:
        header = json.loads(f.read(n))
        meta = header[key]
        tag, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgumentError(f"cannot read {key!r} from {path}: bad header ({exc!r})") from None
    if tag not in _DTYPE_OF_TAG:
        raise InvalidArgumentError(f"{key!r} in {path} has dtype {tag!r}")
    dtype = np.dtype(_DTYPE_OF_TAG[tag])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin and end - begin == nbytes
            and 8 + n + end <= size) or any(d < 0 for d in shape):
        raise InvalidArgumentError(f"{key!r} in {path}: its offsets do not match its shape and "
                                   "the file's size")
    return 8 + n + begin, dtype, shape


def _read_into(f: Any, at: int, out: np.ndarray) -> None:
    view = out.reshape(-1).view(np.uint8).data  # a view: out is C-contiguous
    f.seek(at)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise InvalidArgumentError(f"{f.name} ended early")
        got += n


def read_rows(shape: tuple[int, ...], dtype: np.dtype, parts: list[list[Any]]) -> np.ndarray:
    """Assemble an array from ``[file, key, src_start, src_stop, dst_start]`` row ranges.

    Reads go straight into the result (the header is parsed and checked here: safetensors'
    own reader copies out of a memory map, measured at about 60 % of a plain read); only
    the files' layout is safetensors'."""
    out = np.empty(shape, dtype)
    filled = 0
    for path, key, start, stop, dst in parts:
        try:
            with open(path, "rb", buffering=0) as f:
                at, saved_dtype, saved_shape = _tensor_location(f, path, key)
                if saved_dtype != dtype:
                    raise InvalidArgumentError(f"{key!r} in {path} is {saved_dtype}, expected {dtype}")
                if start is None:
                    if int(np.prod(saved_shape, dtype=np.int64)) != out.size or \
                            (saved_shape != tuple(shape) and saved_shape != (1,)):
                        raise InvalidArgumentError(f"{key!r} in {path} has shape {saved_shape}, "
                                                   f"expected {shape}")
                    _read_into(f, at, out)
                    filled = out.shape[0] if out.ndim else 1
                    continue
                if saved_shape[1:] != tuple(shape[1:]) or not 0 <= start < stop <= saved_shape[0]:
                    raise InvalidArgumentError(f"rows {start}..{stop} of {key!r} in {path} "
                                               f"(shape {saved_shape}) do not fit {shape}")
                row_bytes = int(np.prod(saved_shape[1:], dtype=np.int64)) * dtype.itemsize
                _read_into(f, at + start * row_bytes, out[dst:dst + (stop - start)])
                filled += stop - start
        except FileNotFoundError as exc:
            raise NotFoundError(f"checkpoint file {path} not found") from exc
        except IsADirectoryError as exc:
            raise InvalidArgumentError(f"checkpoint file {path} is a directory") from exc
    expected = shape[0] if len(shape) else 1
    if filled != expected:
        raise InvalidArgumentError(f"checkpoint sources cover {filled} of {expected} rows")
    return out
