"""The checkpoint file format, written by the ps and the coordinator, read by both.

A checkpoint ``<prefix>`` is

* ``<prefix>.ps<K>.safetensors``: the parts ps K holds, written by that ps
  (``<prefix>.local.safetensors`` for variables local to the coordinator);
* ``<prefix>.index.json``: written last, atomically, by the coordinator: for
  each logical variable, keyed by its object-graph path (``model/dense/kernel``,
  see ``object_graph.py``), its dtype, shape, the name it had, and the row
  ranges of its parts (``{"file", "key", "offset", "rows"}``). A checkpoint
  without its index does not exist.

Format version 2 keys variables by path; version 3 is version 2 with table files that
link earlier ones (``table_links.py``), written only by a save that links one, so that
a pstrain that does not read links refuses the checkpoint rather than miss their rows.
Version 1 (pstrain before object-graph checkpoints) keyed them by variable name;
:class:`CheckpointReader` reads every version and says how it is keyed (``keyed_by``),
and ``Checkpoint.restore`` refuses version 1 (names are not stable; see its message).

A reader asks for rows ``[start, stop)`` of a variable and gets *sources*
(``[file, key, src_start, src_stop, dst_start]``) that :func:`read_rows`
assembles, so a variable saved in 4 parts restores into 2, or into 1.
No network here; file I/O only (the tensor files themselves: ``tensor_files.py``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import json
import logging
import math
import os
from typing import Annotated, Any, BinaryIO

import msgspec
import numpy as np

from ..._base.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PstrainError,
    ResourceExhaustedError,
)
from .checksums import checked_index, with_digest
from .delta_files import INDEX, delta_prefix, read_delta_index, read_table_plan, split_delta
from .tensor_files import read_rows, write_atomically

__all__ = [
    "FORMAT",
    "INDEX",
    "CheckpointReader",
    "index_path",
    "make_parent",
    "read_index",
    "remove_checkpoint",
    "sources",
    "unwritten",
    "write_index",
]

logger = logging.getLogger(__name__)

FORMAT = "pstrain-checkpoint"
VERSION = 2
#: The version of a checkpoint whose table files link earlier ones.
LINKED_VERSION = 3

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
    key: Annotated[str, msgspec.Meta(max_length=1024)] = ""  # its name on the ps


class _Index(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    version: int
    variables: dict[str, _Variable]
    save_counter: Annotated[int, msgspec.Meta(ge=0)] = 0
    tables: dict[str, _Table] = {}
    #: this save's version among the directory's saves, full and delta (the serving feed's)
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    #: ps -> [incarnation, mark] taken before the save: it holds every change up to them
    marks: dict[str, tuple[str, int]] = {}


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
    if index.format != FORMAT or index.version not in (1, VERSION, LINKED_VERSION):
        raise InvalidArgumentError(
            f"{path} is not a pstrain checkpoint (format {index.format!r}, version {index.version})"
        )
    for name, var in index.variables.items():
        try:
            dtype = np.dtype(var.dtype)
        except TypeError:
            raise InvalidArgumentError(
                f"checkpoint index {path}: {name!r} has bad dtype {var.dtype!r}"
            ) from None
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
                f"more than its files hold ({on_disk} bytes)"
            )
        rows = var.shape[0] if var.shape else 1
        pos = 0
        for p in sorted(var.parts, key=lambda p: p.offset):
            if p.offset != pos:
                raise InvalidArgumentError(
                    f"checkpoint index {path}: the parts of {name!r} "
                    f"{'overlap' if p.offset < pos else 'leave a gap'} at row {pos}"
                )
            pos += p.rows
        if pos != rows:
            raise InvalidArgumentError(
                f"checkpoint index {path}: the parts of {name!r} cover {pos} of its {rows} rows"
            )
    for name, table in index.tables.items():
        if any(os.path.basename(f) != f or f in (".", "..") for f in table.files):
            raise InvalidArgumentError(f"checkpoint index {path}: table {name!r} names a bad file")
        try:
            if np.dtype(table.dtype).kind != "f":
                raise TypeError
        except TypeError:
            raise InvalidArgumentError(
                f"checkpoint index {path}: table {name!r} has dtype {table.dtype!r}"
            ) from None
    return msgspec.to_builtins(index)


def index_path(path: str) -> str:
    """The index file of checkpoint ``path`` (a prefix, or the index itself).

    >>> index_path("/tmp/run/ckpt-3")
    '/tmp/run/ckpt-3.index.json'
    """
    return path if path.endswith(INDEX) else path + INDEX


def make_parent(prefix: str) -> None:
    """The directory of checkpoint ``prefix``, made if it is not there yet; else
    InvalidArgumentError saying why it cannot be (a file in its way, no permission)."""
    try:
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(
            f"checkpoint {prefix}: its directory cannot be made ({exc.strerror or exc})"
        ) from None


def remove_checkpoint(prefix: str) -> None:
    """Remove checkpoint ``prefix`` (full or delta): its index first, so it stops being
    visible, then every file named ``<prefix>.*`` (a full checkpoint's deltas too)."""
    for path in [prefix + INDEX, *glob.glob(glob.escape(prefix) + ".*")]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


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
    return _check_index(index_path(path), checked_index(index_path(path), index))


def unwritten(path: str, exc: OSError) -> PstrainError:
    """The error for checkpoint file ``path`` not written for ``exc``, as TensorFlow's file
    systems map it: a full disk or quota is ResourceExhaustedError (free space, or save
    elsewhere: the save can be made again), anything else (no permission, a read-only or
    failing disk) FailedPreconditionError."""
    what = f"checkpoint {path} could not be written: {exc.strerror or exc}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ResourceExhaustedError(f"{what} (free some space, or save elsewhere)")
    return FailedPreconditionError(what)


def write_index(
    prefix: str,
    variables: dict[str, Any],
    save_counter: int = 0,
    tables: dict[str, Any] | None = None,
    seq: int = 0,
    marks: dict[str, Any] | None = None,
    linked: bool = False,
) -> None:
    """Write the index of checkpoint ``prefix`` atomically (temp file, fsync, rename);
    ``linked``: a table file links an earlier one (format version 3)."""
    path = index_path(prefix)

    index = {
        "format": FORMAT,
        "version": LINKED_VERSION if linked else VERSION,
        "save_counter": save_counter,
        "seq": seq,
        "marks": marks or {},
        "variables": variables,
        **({"tables": tables} if tables else {}),
    }
    body = with_digest(index)

    def write(f: BinaryIO) -> None:
        f.write(json.dumps(body, indent=1).encode())

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
            out.append(
                [os.path.join(base, p["file"]), p["key"], lo - p["offset"], hi - p["offset"], lo - start]
            )
    return out


class CheckpointReader:
    """One checkpoint: its index read and checked once, its variables read when asked.

    ``path`` may name a delta (``<base>.delta-<K>``, ``delta_files.py``): the reader then
    gives the state of the base with deltas 1..K applied, in order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.base = checkpoint_dir(path)
        split = split_delta(os.path.abspath(path.removesuffix(INDEX)))
        self.deltas: list[dict[str, Any]] = []
        if split is None:
            self.index = read_index(path)
            return
        base, number = split
        self.index = read_index(base)
        for k in range(1, number + 1):
            delta = read_delta_index(delta_prefix(base, k))
            if delta["base"] != os.path.basename(base) or delta["delta"] != k:
                raise InvalidArgumentError(
                    f"delta {delta_prefix(base, k)} names base {delta['base']!r} and number {delta['delta']}"
                )
            self.deltas.append(delta)

    @property
    def keyed_by(self) -> str:
        """``"path"`` (format 2, object graph) or ``"name"`` (format 1)."""
        return "path" if self.index["version"] >= 2 else "name"

    @property
    def save_counter(self) -> int:
        return int(self.index.get("save_counter", 0))

    @property
    def seq(self) -> int:
        """The version of the state read: its last save's (full or delta)."""
        return int((self.deltas[-1] if self.deltas else self.index).get("seq", 0))

    @property
    def variables(self) -> dict[str, Any]:
        """The index's entry of each variable, by path (by name in format 1); a variable
        created after the base has the entry of the first delta that holds it whole."""
        return self._variables[0]

    @functools.cached_property
    def _variables(self) -> tuple[dict[str, Any], dict[str, list[tuple[int, dict[str, Any]]]]]:
        """(:attr:`variables`, each one's entries in the deltas with their numbers, oldest
        first). A variable is known across saves by its path (a program that restored the
        base and wrote the deltas may name it otherwise on the ps); one not in the base is
        read from the first delta that holds it whole, and left out, with a warning, if
        none does (tracked after the base, made before it)."""
        variables: dict[str, Any] = dict(self.index["variables"])
        in_deltas: dict[str, list[tuple[int, dict[str, Any]]]] = {name: [] for name in variables}
        for k, delta in enumerate(self.deltas, 1):
            for name, meta in delta["variables"].items():
                parts = meta["parts"]
                if name in variables:
                    in_deltas[name].append((k, meta))
                    continue
                if not parts or not all(p["whole"] for p in parts):
                    logger.warning(
                        "checkpoint %s: %r is not in its base, and delta %d holds only its rows "
                        "changed since: it is left out",
                        self.path,
                        name,
                        k,
                    )
                    continue
                variables[name] = {
                    **meta,
                    "from_delta": k,
                    "parts": [
                        {
                            "file": p["file"],
                            "key": f"v:{p['key']}:rows",
                            "offset": p["offset"],
                            "rows": p["rows"],
                        }
                        for p in parts
                    ],
                }
                in_deltas[name] = []
        return variables, in_deltas

    @property
    def tables(self) -> dict[str, Any]:
        """The index's entry of each dynamic table, by path; a table created after the base
        has the entry of the first delta that holds it, with no files of the base
        (``files`` empty: its deltas hold all of it)."""
        return self._tables[0]

    def table_deltas(self, path: str) -> list[list[tuple[str, str]]]:
        """Each delta's ``(file, key prefix)`` pairs of table ``path``, oldest first."""
        return [
            [(os.path.join(self.base, f), meta["prefix"] + ":") for f in meta["files"]]
            for meta in self._tables[1].get(path, [])
        ]

    @functools.cached_property
    def _tables(self) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
        """(:attr:`tables`, each table's entries in the deltas, oldest first). A table is
        known across saves by its path, as a variable is; one not in the base is read from
        the first delta that holds it whole (made on the ps after the mark before it:
        ``whole``), and left out, with a warning, if that delta does not say so."""
        tables: dict[str, Any] = dict(self.index.get("tables", {}))
        in_deltas: dict[str, list[dict[str, Any]]] = {path: [] for path in tables}
        skipped: set[str] = set()
        for k, delta in enumerate(self.deltas, 1):
            for path, meta in delta["tables"].items():
                if path in skipped:
                    continue
                if path not in tables:
                    if not meta.get("whole"):  # (a delta of pstrain 0.2 says nothing of it)
                        logger.warning(
                            "checkpoint %s: table %r is not in its base, and delta %d may hold only "
                            "its rows changed since: it is left out",
                            self.path,
                            path,
                            k,
                        )
                        skipped.add(path)
                        continue
                    tables[path] = {**meta, **self._born_in(k, meta), "files": [], "from_delta": k}
                    in_deltas[path] = []
                in_deltas[path].append(meta)
        return tables, in_deltas

    def _born_in(self, k: int, meta: dict[str, Any]) -> dict[str, Any]:
        """The width, dtype and configuration of a table delta ``k`` holds first (whole)."""
        dim, dtype = meta.get("dim"), meta.get("dtype")
        try:
            if dim is None or np.dtype(dtype).kind != "f":
                raise TypeError
        except TypeError:
            raise InvalidArgumentError(
                f"delta {k} of {self.path}: table {meta['name']!r} holds all its rows but has "
                f"width {dim!r} and dtype {dtype!r}"
            ) from None
        return {"dim": int(dim), "dtype": np.dtype(dtype).name, "config": meta.get("config") or {}}

    def rows_of(
        self, name: str, start: int, stop: int, scalar: bool
    ) -> tuple[list[list[Any]], list[list[Any]]]:
        """Rows ``[start, stop)`` of variable ``name``: the sources (``read_rows``'s) and
        the deltas' patches that follow them."""
        meta = self.variables[name]
        rows = sources(meta, self.base, start, stop, scalar)
        patches = []
        for number, saved in self._variables[1].get(name, []):
            if saved["shape"] != meta["shape"] or saved["dtype"] != meta["dtype"]:
                raise InvalidArgumentError(
                    f"delta {number} of {self.path}: {name!r} is {saved['shape']} "
                    f"{saved['dtype']}, the checkpoint's {meta['shape']} {meta['dtype']}"
                )
            for p in saved["parts"]:
                lo, hi = p["offset"], p["offset"] + p["rows"]
                if scalar or (lo < stop and hi > start):
                    patches.append(
                        [
                            os.path.join(self.base, p["file"]),
                            f"v:{p['key']}:rows",
                            None if scalar else f"v:{p['key']}:idx",
                            lo - start,
                        ]
                    )
        return rows, patches

    def read_table(self, path: str) -> dict[str, np.ndarray]:
        """A saved dynamic table whole: ``ids`` (ascending), ``rows`` and ``slot:<key>`` arrays."""
        meta = self.tables[path]
        ids, rows, slots, _ = read_table_plan(
            [os.path.join(self.base, f) for f in meta["files"]],
            self.table_deltas(path),
            0,
            1,
            int(meta["dim"]),
            np.dtype(meta["dtype"]),
        ).read_whole()
        order = np.argsort(ids, kind="stable")
        return {"ids": ids[order], "rows": rows[order], **{f"slot:{k}": v[order] for k, v in slots.items()}}

    def read(self, name: str) -> np.ndarray | None:
        """Variable ``name`` as a full array (None if the checkpoint does not have it)."""
        meta = self.variables.get(name)
        if meta is None:
            return None
        shape = tuple(meta["shape"])
        return read_rows(
            shape, np.dtype(meta["dtype"]), *self.rows_of(name, 0, shape[0] if shape else 1, not shape)
        )
