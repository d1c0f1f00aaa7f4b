"""Records read from a file in numpy: by ``os.preadv``, one run of records at a time (the
compiled kernels submit a segment's runs to io_uring where the kernel gives a ring), and
those the page cache holds alone by ``os.preadv`` with ``RWF_NOWAIT``."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["cached_records", "io_uring_reads", "pread_records"]


def io_uring_reads() -> bool:
    """The numpy kernels read records by ``os.preadv``, never through io_uring."""
    return False


def pread_records(fd: int, records: np.ndarray, width: int, out: np.ndarray, offset: int = 0) -> int:
    if out.shape[0] < records.size or out.shape[1] != width:
        raise ValueError("pread_records: out must be (records, width)")
    if offset < 0:
        raise ValueError("pread_records: offset must be at least 0")
    for lo, hi in _runs(records):
        want = (hi - lo) * width
        try:
            got = os.preadv(fd, [out[lo:hi].data], offset + int(records[lo]) * width)
        except OSError as exc:
            return exc.errno or -1
        if got != want:
            return -1
    return 0


def _runs(records: np.ndarray) -> list[tuple[int, int]]:
    """(first, end) of each run of neighbouring ``records``."""
    breaks = np.flatnonzero(np.diff(records) != 1) + 1
    return [(lo, hi) for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), records.size]) if lo < hi]


def cached_records(
    fd: int,
    records: np.ndarray,
    width: int,
    out: np.ndarray,
    missed: np.ndarray,
    offset: int = 0,
    uring: bool = True,
) -> int:
    if out.shape[0] < records.size or out.shape[1] != width:
        raise ValueError("cached_records: out must be (records, width)")
    if missed.shape[0] < records.size:
        raise ValueError("cached_records: missed must hold a byte a record")
    if offset < 0:
        raise ValueError("cached_records: offset must be at least 0")
    nowait: int | None = getattr(os, "RWF_NOWAIT", None)
    missed[: records.size] = nowait is None  # (a platform without it: every record missed)
    if nowait is None:
        return 0
    for lo, hi in _runs(records):
        try:
            got = os.preadv(fd, [out[lo:hi].data], offset + int(records[lo]) * width, nowait)
        except OSError:
            got = -1
        if got != (hi - lo) * width:
            missed[lo:hi] = 1
    return int(records.size - np.count_nonzero(missed[: records.size]))
