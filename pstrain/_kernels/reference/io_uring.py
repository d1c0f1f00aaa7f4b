"""Records read from a file in numpy: by ``os.preadv``, one run of records at a time (the
compiled kernels submit a segment's runs to io_uring where the kernel gives a ring)."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["io_uring_reads", "pread_records"]


def io_uring_reads() -> bool:
    """The numpy kernels read records by ``os.preadv``, never through io_uring."""
    return False


def pread_records(fd: int, records: np.ndarray, width: int, out: np.ndarray, offset: int = 0) -> int:
    if out.shape[0] < records.size or out.shape[1] != width:
        raise ValueError("pread_records: out must be (records, width)")
    if offset < 0:
        raise ValueError("pread_records: offset must be at least 0")
    n = records.size
    breaks = np.flatnonzero(np.diff(records) != 1) + 1
    for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), n]):
        if lo >= hi:
            continue
        want = (hi - lo) * width
        try:
            got = os.preadv(fd, [out[lo:hi].data], offset + int(records[lo]) * width)
        except OSError as exc:
            return exc.errno or -1
        if got != want:
            return -1
    return 0
