"""A tiered shard set aside on disk while a restore in place replaces it.

A restore builds the new shard beside the one it replaces, which is served until the new
one is put in place (or, if the restore fails or is aborted, from then on as before). A
tiered ps whose budget cannot hold both, the old shard's rows in RAM and index of its
rows on disk beside the new shard's, sets the old one aside instead: every array it
holds in RAM (the hot rows, their slots and bookkeeping, both indexes) is written to a
file in its tier's directory and let go, so that the new shard has the budget to itself.
Its rows on disk stay where they are. Requests for the table wait meanwhile (the restore
replaces what they would read); a restore that commits discards the old shard with its
directory, one that fails or is aborted reads the arrays back, as they were, and the
table is served again.

The arrays are written as they are (``numpy``'s own format, one after the other) and read
back in the same order: nothing is rebuilt, so the shard comes back exactly, its indexes
and statistics with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...._base.errors import ResourceExhaustedError

if TYPE_CHECKING:
    from .dynamic_table import DynamicTable
    from .tiered_table import TieredTable

__all__ = ["SetAside", "SetAsides"]

logger = logging.getLogger(__name__)

#: The file a shard's arrays are set aside in, in its tier's directory.
FILE = "set-aside.npy"


class SetAside:
    """``table``'s arrays, written to disk and let go (:meth:`write`), and read back
    (:meth:`read_back`). Both run on a thread, while nothing else touches the table."""

    def __init__(self, table: TieredTable) -> None:
        self.table = table
        self.path = os.path.join(table.cold.directory, FILE)
        self.held: list[tuple[dict[str, Any], Any]] = []  # (holder, key) of each array written
        self.nbytes = 0  # what was let go

    def write(self) -> None:
        """Write every array, then let them all go (a disk that fills: ResourceExhaustedError,
        and the table as it was)."""
        held = [(h, k) for h in self.table.array_holders() for k, v in h.items() if isinstance(v, np.ndarray)]
        try:
            with open(self.path, "wb") as f:
                for holder, key in held:
                    np.lib.format.write_array(f, np.ascontiguousarray(holder[key]), allow_pickle=False)
        except OSError as exc:
            _remove(self.path)
            raise ResourceExhaustedError(
                f"dynamic table {self.table.name!r}: could not set its shard aside in "
                f"{self.table.cold.directory} for a restore in place ({exc})"
            ) from exc
        self.held = held
        for holder, key in held:
            arr = holder[key]
            self.nbytes += arr.nbytes
            holder[key] = np.empty((0, *arr.shape[1:]), arr.dtype)

    def read_back(self) -> None:
        """Read every array back into its place, as it was; the file goes."""
        with open(self.path, "rb") as f:
            for holder, key in self.held:
                holder[key] = np.lib.format.read_array(f, allow_pickle=False)
        self.held = []
        _remove(self.path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class Tables(Protocol):
    """What :class:`SetAsides` needs of the ps's tables (``handlers.py``'s ``TableHandlers``)."""

    tables: dict[str, DynamicTable]

    @property
    def task(self) -> str: ...


@dataclasses.dataclass
class _Aside:
    """A shard set aside: requests for its table wait for ``done``, set once it is replaced
    or served again."""

    table: TieredTable
    arrays: SetAside
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    back: asyncio.Task[None] | None = None  # its arrays being read back


class SetAsides:
    """The shards of a ps's tables (``tables.tables``) set aside for restores in place,
    and the tiered restores under way, by table. A shard set aside comes back once no
    restore of its table is under way or staged (``staged(name)``), unless one was put in
    its place (:meth:`replaced`)."""

    def __init__(self, tables: Tables, staged: Callable[[str], bool]) -> None:
        self.tables = tables
        self.staged = staged
        self.aside: dict[str, _Aside] = {}
        self.restoring: dict[str, int] = {}
        self.count = 0  # shards set aside so far

    def __contains__(self, name: str) -> bool:
        return name in self.aside

    def __len__(self) -> int:
        return len(self.aside)

    @contextlib.asynccontextmanager
    async def under_way(self, name: str) -> AsyncIterator[None]:
        """A tiered restore of table ``name`` under way (after a shard of it being read back
        is back: counted then); a shard of it set aside is served again once none is, unless
        one put its shard in place or staged it."""
        aside = self.aside.get(name)
        if aside is not None and aside.back is not None:
            await asyncio.shield(aside.back)
        self.restoring[name] = self.restoring.get(name, 0) + 1
        try:
            yield
        finally:
            self.restoring[name] -= 1
            if not self.restoring[name]:
                del self.restoring[name]
            back = self.settle(name)
            if back is not None:  # (failed: the shard set aside is served again when this ends)
                with contextlib.suppress(Exception):  # (logged: this restore's error is the one)
                    await asyncio.shield(back)

    async def set_aside(self, name: str, table: TieredTable) -> None:
        """Set shard ``table`` of table ``name`` aside on disk: from now on requests for the
        table wait until it is replaced or served again. A disk that cannot take it:
        ResourceExhaustedError, nothing changed."""
        if table.saves or table.cold.saves:  # (saves and restores take turns: not expected)
            raise ResourceExhaustedError(
                f"dyn/restore of {name!r}: the shard it replaces and the restored one do not both "
                f"fit the budget of {self.tables.task}, and a save is reading the old one: "
                "restore after the save"
            )
        aside = self.aside[name] = _Aside(table, SetAside(table))
        del self.tables.tables[name]  # (its disk stays: not ``drop``)
        try:
            await table.cold.reads_ended()  # (a request's rows being read from its disk)
            await asyncio.to_thread(aside.arrays.write)
        except BaseException:
            del self.aside[name]
            self.tables.tables[name] = table
            aside.done.set()
            raise
        self.count += 1
        logger.info(
            "%s: table %r set aside on disk (%d bytes of RAM) while a restore replaces it",
            self.tables.task,
            name,
            aside.arrays.nbytes,
        )

    def settle(self, name: str) -> asyncio.Task[None] | None:
        """The shard of ``name`` set aside comes back if no restore of the table is under way
        or staged any more (none put in its place): returns what reads it back."""
        aside = self.aside.get(name)
        if aside is None or aside.back is not None or name in self.restoring:
            return aside.back if aside is not None else None
        if self.staged(name):
            return None
        aside.back = asyncio.get_running_loop().create_task(self._read_back(name, aside))
        return aside.back

    async def _read_back(self, name: str, aside: _Aside) -> None:
        try:
            await asyncio.to_thread(aside.arrays.read_back)
        except BaseException:  # its disk failed it: the table is gone from this ps
            logger.exception("%s: table %r set aside could not be read back", self.tables.task, name)
            aside.table.cold.discard()
            raise
        else:
            if self.aside.get(name) is aside and name not in self.tables.tables:
                self.tables.tables[name] = aside.table
            else:  # (replaced meanwhile)
                aside.table.cold.discard()
        finally:
            if self.aside.get(name) is aside:
                del self.aside[name]
            aside.done.set()

    def replaced(self, name: str) -> TieredTable | None:
        """A restore put its shard of ``name`` in place: the shard set aside for it, if any,
        goes with its disk (returned, for its counters)."""
        aside = self.aside.pop(name, None)
        if aside is None:
            return None
        aside.table.cold.discard()
        aside.done.set()
        return aside.table

    async def brought_back(self) -> None:
        """Wait for the shards set aside that are being read back (a restore aborted)."""
        backs = [aside.back for aside in self.aside.values() if aside.back is not None]
        await asyncio.gather(*(asyncio.shield(back) for back in backs), return_exceptions=True)

    async def settled(self, names: Iterable[str]) -> None:
        """Wait while any of the tables ``names`` is set aside."""
        for name in names:
            while (aside := self.aside.get(name)) is not None:
                await aside.done.wait()
