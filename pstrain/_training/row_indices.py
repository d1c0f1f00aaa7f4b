"""A sliced dataset's row indices, moved in blocks: what ``shard``, ``shuffle``, ``repeat``,
``take``, ``skip`` and ``batch`` do to the rows of ``from_tensor_slices`` before a batch gathers them.

Each step is a factory of iterators of blocks (int64 arrays of row indices, in order), so a
batch's indices cost a few numpy calls and, for a shuffle, one compiled loop, not a Python
step per example. Each step gives the rows its element-by-element twin in ``data.py`` gives,
in the same order: a seeded shuffle draws the same numbers and emits the same rows.

>>> blocks = sharded(rows(10), 3, 1)
>>> [b.tolist() for b in batches(blocks, 2, drop_remainder=False)()]
[[1, 4], [7]]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np

from .._kernels import KERNELS

__all__ = [
    "BLOCK",
    "Blocks",
    "batches",
    "each",
    "repeated",
    "rows",
    "sharded",
    "shuffled",
    "skipped",
    "taken",
]

#: Rows per block from the source (a step may pass on smaller ones).
BLOCK = 4096
#: A factory of iterators of row blocks: each call starts from the beginning.
Blocks = Callable[[], Iterator[np.ndarray]]
#: Random numbers a shuffle draws at a time (as its element-by-element twin does).
DRAWS = 1024


def rows(n: int) -> Blocks:
    """Rows 0 to ``n - 1``."""

    def run() -> Iterator[np.ndarray]:
        for start in range(0, n, BLOCK):
            yield np.arange(start, min(start + BLOCK, n), dtype=np.int64)

    return run


def each(blocks: Blocks) -> Iterator[int]:
    """The rows one by one (a dataset iterated element by element)."""
    for block in blocks():
        yield from block.tolist()


def sharded(blocks: Blocks, num_shards: int, index: int) -> Blocks:
    """Every ``num_shards``-th row, starting at the ``index``-th."""

    def run() -> Iterator[np.ndarray]:
        seen = 0
        for block in blocks():
            first = (index - seen) % num_shards
            seen += block.size
            if first < block.size:
                yield np.ascontiguousarray(block[first::num_shards])

    return run


def taken(blocks: Blocks, count: int) -> Blocks:
    """The first ``count`` rows (all when negative)."""
    if count < 0:
        return blocks

    def run() -> Iterator[np.ndarray]:
        left = count
        if left == 0:
            return
        for block in blocks():
            if block.size >= left:
                yield block[:left]
                return
            left -= block.size
            yield block

    return run


def skipped(blocks: Blocks, count: int) -> Blocks:
    """All but the first ``count`` rows (none when negative)."""

    def run() -> Iterator[np.ndarray]:
        if count < 0:
            return
        left = count
        for block in blocks():
            if left >= block.size:
                left -= block.size
                continue
            yield block[left:]
            left = 0

    return run


def repeated(blocks: Blocks, count: int | None) -> Blocks:
    """The rows ``count`` times over (forever when None or negative), each pass a new
    iteration of ``blocks``; none at all if a pass has none."""

    def run() -> Iterator[np.ndarray]:
        passes = range(count) if count is not None and count >= 0 else itertools.count()
        for _ in passes:
            empty = True
            for block in blocks():
                if block.size:
                    empty = False
                    yield block
            if empty:
                return

    return run


def shuffled(blocks: Blocks, buffer_size: int, rng: Callable[[], np.random.Generator]) -> Blocks:
    """TF's buffer shuffle: the first ``buffer_size`` rows fill a buffer; each row after
    takes the place of a random one, which is emitted; the buffer's rows come last, in a
    random order."""

    def run() -> Iterator[np.ndarray]:
        r = rng()
        it = blocks()
        filling: list[np.ndarray] = []
        held = 0
        rest = None
        for block in it:
            if held + block.size <= buffer_size:
                filling.append(block)
                held += block.size
                continue
            filling.append(block[: buffer_size - held])
            rest = block[buffer_size - held :]
            break
        buf = np.concatenate(filling) if filling else np.zeros(0, np.int64)  # (a copy: written)
        draws = np.zeros(0)
        used = 0

        def through(block: np.ndarray) -> np.ndarray:
            nonlocal draws, used
            need, parts = block.size, []
            while need:
                if used == draws.size:
                    draws, used = r.random(DRAWS), 0
                take = min(need, draws.size - used)
                parts.append(draws[used : used + take])
                used += take
                need -= take
            out = np.empty(block.size, np.int64)
            chosen = parts[0] if len(parts) == 1 else np.concatenate(parts)
            KERNELS.shuffle_through(buf, np.ascontiguousarray(block, np.int64), chosen, out)
            return out

        if rest is not None:
            if rest.size:
                yield through(rest)
            for block in it:
                if block.size:
                    yield through(block)
        if buf.size:
            yield buf[r.permutation(buf.size)]

    return run


def batches(blocks: Blocks, batch_size: int, drop_remainder: bool) -> Blocks:
    """The rows ``batch_size`` at a time (a shorter last batch unless ``drop_remainder``)."""

    def run() -> Iterator[np.ndarray]:
        pending: list[np.ndarray] = []
        held = 0
        for block in blocks():
            pending.append(block)
            held += block.size
            if held < batch_size:
                continue
            joined = np.concatenate(pending) if len(pending) > 1 else pending[0]
            start = 0
            while held - start >= batch_size:
                yield joined[start : start + batch_size]  # (blocks are contiguous: so is a slice)
                start += batch_size
            pending = [joined[start:]] if start < held else []
            held -= start
        if held and not drop_remainder:
            yield np.concatenate(pending)

    return run
