"""Files a full save of a table links rather than writes again.

A tiered shard restored from a checkpoint keeps the files of that checkpoint's base as
segments of its disk tier (hard links, read where they lie; ``cold_rows.py``), and most of
their rows never change afterwards. A full save of the shard then does not write those
rows again: it hard-links each such file beside its own file and says which of its rows
are the table's now. Table file ``<stem>.safetensors`` of a full save may so hold

* ``linked:<k>`` (uint8, a bit per row of the file linked, row ``i`` in bit ``i % 8`` of
  byte ``i // 8``: numpy's ``packbits(..., bitorder="little")``): which rows of
  ``<stem>.link-<k>.safetensors``, the file's ``k``-th link, belong to the save.

The save's rows are its own file's and those of its links (each id in one of them only).
A linked file is read for its ``ids``, ``rows`` and ``slot:<name>`` alone: the bits
replace its own ``live``, its own links are not followed (the bits already say which of
its rows are the save's), and its initial values are the linking file's. A linked file
has the same checksums it had when first written; checkpoint files are never written
once named, so a link is the same bytes as the file it was made from. Deleting a
checkpoint (``<prefix>.*``) deletes its links by name; a later checkpoint that linked the
same file keeps it. No network here; file I/O only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

from ..._base.errors import InvalidArgumentError

__all__ = ["LINKED", "link_name", "linked_parts", "pack", "rows_of"]

#: The key prefix of a link's bits in the linking file.
LINKED = "linked:"
_SUFFIX = ".safetensors"
_NUMBER = re.compile(r"^(0|[1-9][0-9]{0,5})$")


def link_name(path: str, k: int) -> str:
    """The name of link ``k`` of table file ``path``.

    >>> link_name("/ckpt/run-3.ps0.table-emb.safetensors", 0)
    '/ckpt/run-3.ps0.table-emb.link-0.safetensors'
    """
    return f"{path.removesuffix(_SUFFIX)}.link-{k}{_SUFFIX}"


def pack(mask: np.ndarray) -> np.ndarray:
    """``mask`` (bool) as a link's bits.

    >>> pack(np.array([True, False, False, True, False, False, False, False, True])).tolist()
    [9, 1]
    """
    return np.packbits(mask, bitorder="little")


def linked_parts(
    path: str, keys: Iterable[str], read: Callable[[str], np.ndarray]
) -> list[tuple[str, np.ndarray]]:
    """The links of table file ``path`` (whose tensors are named ``keys``, read with
    ``read``): each linked file's path and its bits (:func:`rows_of` makes them a mask once
    the linked file's rows are known), in link order. InvalidArgumentError for bits that
    are not a link's."""
    out = []
    for key in sorted(k for k in keys if k.startswith(LINKED)):
        number = key[len(LINKED) :]
        if not _NUMBER.match(number) or not path.endswith(_SUFFIX):
            raise InvalidArgumentError(f"dyn/restore: {path} names a link {key!r} that is not one")
        bits = read(key)
        if bits.dtype != np.uint8 or bits.ndim != 1:
            raise InvalidArgumentError(
                f"dyn/restore: {key} in {path} is {bits.dtype} {bits.shape}, not a link's bits"
            )
        out.append((link_name(path, int(number)), bits))
    return out


def rows_of(path: str, ids: np.ndarray, bits: np.ndarray, linking: str) -> np.ndarray:
    """Which rows of linked file ``path`` (its ``ids``) are the save's, from the bits
    ``linking`` gave for it; InvalidArgumentError if they are not for as many rows."""
    if bits.size != (ids.size + 7) // 8 or (ids.size % 8 and bits[-1] >> (ids.size % 8)):
        raise InvalidArgumentError(
            f"dyn/restore: {path} holds {ids.size} rows, but {linking} links {bits.size} bytes of "
            "bits for it (another file under its name)"
        )
    return np.unpackbits(bits, count=ids.size, bitorder="little").view(bool)
