"""The serving feed of a ps: ``GET /v1/tables/<name>/rows?since=<version>``.

A serving store follows training by asking each ps, with the cluster token, for
the rows of its shard of a table changed since the version it last got. The
answer is read from the table's checkpoint and delta files (the rules:
``_formats/files/table_feed.py``), so versions are the saves' own (``seq``) and
survive a restarted ps: once the coordinator has restored it, it answers for
the same versions again.

The reply is a safetensors file: ``ids`` (int64), ``rows`` (``[n, dim]``) and
``removed`` (int64), with ``__metadata__`` ``version``, ``reset`` (``"true"``:
replace the whole shard with these rows; else drop ``removed``, then put ``ids``
in), ``since``, ``table``, ``shard``, ``num_shards`` and ``task`` (once part of a
table moved between ps, ``shard`` lists the slices of ``num_shards`` this ps holds,
comma-separated, and the rows moved in come in its next version); the same
values come as ``X-Pstrain-*`` headers. Query ``since`` absent: the whole shard.

The ps learns where a table's saves are from the saves and restores it serves
(``ckpt/save``, ``delta/save``, ``dyn/restore``); a table never saved nor restored
here has no feed yet (FailedPreconditionError, 412).

Every file the feed reads is confined to the checkpoint root as a restore's are (a
link out of it is refused, 400). Memory follows the bytes sent, not the readers: a
reply holds the ids it sends and its save files open, and reads the rows from them
a piece at a time as the reader takes them; at most ``max_readers`` replies are
under way at once (past that: 503 with ``Retry-After``), and a reader that stops
taking its reply is dropped after ``SEND_TIMEOUT_S`` (``_serving/http.py``).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator

import numpy as np

from ...._base.cluster import Named, named
from ...._base.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnavailableError
from ...._formats.files.table_feed import Confine, FeedReply, IndexCache, read_feed
from ...._formats.files.tensor_files import safetensors_header
from ...._formats.numerics.idhash import Shard
from ...._serving.core import Download
from ..tables.dynamic_table import DynamicTable

__all__ = ["PATH", "TableFeed"]

#: The feed's HTTP path.
PATH = "/v1/tables/{name:.+}/rows"  # (a name may hold "/": a collection's tables do)
_VERSION = re.compile(r"^[0-9]{1,18}$")  # (ASCII digits: \d takes any script's)
_ATTEMPTS = 3  # a save pruned while it was read: read the directory again
#: Replies under way at once on one ps (each holds its ids and a piece of rows).
MAX_READERS = 4
#: Rows read from the files at a time for one reply.
PIECE_ROWS = 4096


class TableFeed:
    """Where each table of one ps was saved, its shard, and the feed that reads them."""

    def __init__(
        self,
        task: str | Named,
        tables: dict[str, DynamicTable],
        confine: Confine,
        max_readers: int = MAX_READERS,
    ) -> None:
        self._name = named(task)  # the ps's name and index as they are now (renamed on a join)
        self.tables = tables
        self.confine = confine  # every path read goes through it (the checkpoint root's)
        self.max_readers = max_readers
        self.readers = 0  # replies under way
        #: table -> the directory of its last save or restore here
        self.directories: dict[str, str] = {}
        #: table -> (shard, number of shards), as its coordinator placed it
        self.placement: dict[str, tuple[Shard, int]] = {}
        #: table -> the change epoch at which its rows were last replaced (created or restored)
        self.reset_at: dict[str, int] = {}
        #: table -> the change epoch from which this ps holds its slices (a move ended)
        self.moved_at: dict[str, int] = {}
        #: directory -> its parsed indexes (``_formats/files/table_feed.py``)
        self.indexes: dict[str, IndexCache] = {}

    @property
    def task(self) -> str:
        return self._name.task

    @property
    def index(self) -> int:
        return self._name.index

    def placed(self, name: str, shard: Shard, num_shards: int) -> None:
        """Table ``name`` here is shard ``shard`` of ``num_shards`` (or, once part of it
        moved, the slices ``shard`` of ``num_shards``)."""
        self.placement[name] = (shard, num_shards)

    def moved(self, name: str, slices: list[int], num_slices: int, epoch: int) -> None:
        """This ps holds slices ``slices`` of ``num_slices`` of table ``name`` from change
        epoch ``epoch`` on: a reader's copy from an older save is reset."""
        self.placement[name] = (slices, num_slices)
        self.moved_at[name] = epoch

    def replaced(self, name: str, epoch: int) -> None:
        """Table ``name``'s rows were replaced (created or restored) at change epoch ``epoch``:
        marks taken before it do not describe them."""
        self.reset_at[name] = epoch

    def saved(self, name: str, path: str) -> None:
        """Table ``name`` was saved to, or restored from, the file ``path``."""
        self.directories[name] = os.path.dirname(os.path.abspath(path))

    async def changes(self, name: str, since: int | None) -> FeedReply:
        """What this ps's shard of ``name`` changed since version ``since``."""
        table = self.tables.get(name)
        if table is None:
            raise NotFoundError(
                f"table feed: dynamic table {name!r} not found on {self.task} "
                "(a name it does not know, or a table not created here yet: a "
                "table is created on each ps by its first use)"
            )
        directory = self.directories.get(name)
        if directory is None:
            raise FailedPreconditionError(
                f"table feed: table {name!r} has not been saved or restored on {self.task} "
                "since it started: the feed serves saved versions (CheckpointManager(..., "
                "delta_interval_s=...))"
            )
        placement = self.placement.get(name)
        if placement is None:
            raise FailedPreconditionError(
                f"table feed: {self.task} does not know which shard of "
                f"{name!r} it holds (created by an older coordinator)"
            )
        shard, num_shards = placement
        dim, dtype, reset_at = table.config.dim, table.dtype, self.reset_at.get(name, 0)
        for attempt in range(_ATTEMPTS):
            try:
                return await asyncio.to_thread(
                    read_feed,
                    directory,
                    name,
                    self.index,
                    shard,
                    num_shards,
                    dim,
                    dtype,
                    since,
                    reset_at,
                    self.indexes.setdefault(directory, {}),
                    self.moved_at.get(name, 0),
                    self.confine,
                )
            except (FailedPreconditionError, InvalidArgumentError, NotFoundError):
                # (a file of the listed saves gone before it was opened: a save pruned
                # meanwhile, whose newer saves the next listing finds)
                if attempt == _ATTEMPTS - 1:  # not a save pruned meanwhile: the directory is bad
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def serve(self, params: dict[str, str], query: dict[str, str]) -> Download:
        """The HTTP resource (``PATH``)."""
        name = params.get("name", "")
        raw = query.get("since")
        if raw is not None and not _VERSION.match(raw):
            raise InvalidArgumentError(f"table feed: since={raw!r} is not a version (a number the feed gave)")
        unknown = sorted(set(query) - {"since"})
        if unknown:
            raise InvalidArgumentError(
                f"table feed: unknown query parameter(s) {unknown}; the feed takes since=<version>"
            )
        since = int(raw) if raw is not None else None
        if self.readers >= self.max_readers:
            busy = UnavailableError(
                f"table feed: {self.readers} replies are under way on "
                f"{self.task}, its most at once; ask again shortly"
            )
            busy.retry_after_s = 1  # type: ignore[attr-defined]
            raise busy
        self.readers += 1
        try:
            reply = await self.changes(name, since)
        except BaseException:
            self.readers -= 1
            raise
        shard, num_shards = self.placement[name]
        metadata = {
            "version": str(reply.version),
            "reset": "true" if reply.reset else "false",
            "since": "" if since is None else str(since),
            "table": name,
            "shard": str(shard) if isinstance(shard, int) else ",".join(map(str, shard)),
            "num_shards": str(num_shards),
            "task": self.task,
        }
        n = reply.ids.size
        head, _ = safetensors_header(
            [
                ("ids", np.dtype(np.int64), (n,)),
                ("rows", reply.dtype, (n, reply.dim)),
                ("removed", np.dtype(np.int64), reply.removed.shape),
            ],
            metadata,
        )
        headers = {
            f"X-Pstrain-{k.replace('_', '-').title()}": v
            for k, v in metadata.items()
            if k in ("version", "reset", "since")
        }

        def pieces() -> Iterator[memoryview]:
            for rows in reply.iter_rows(PIECE_ROWS):
                yield np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data
            yield reply.removed.view(np.uint8).data

        def close() -> None:
            reply.close()
            self.readers -= 1

        return Download(
            [head, reply.ids.view(np.uint8).data],
            "application/octet-stream",
            headers,
            stream=pieces(),
            length=reply.rows_nbytes + reply.removed.nbytes,
            close=close,
        )
