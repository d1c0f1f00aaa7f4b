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

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ...._base.errors import ResourceExhaustedError

if TYPE_CHECKING:
    from .tiered_table import TieredTable

__all__ = ["SetAside"]

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
