"""Large checkpoint files written past the page cache (``O_DIRECT``), through one reused
aligned buffer.

A ps writes saves and deltas while training goes on, on the same cores. Written the usual
way, every byte is first copied into pages of the page cache, and a file never written
before takes pages never used before: on the VM the benchmarks run on, that costs 0.19 s of
CPU per 77 MB (the copy itself: 0.02 s), about three quarters of a delta's CPU on the ps.
Written with ``O_DIRECT``, the disk reads the bytes straight from one 8 MiB buffer that
every file of the thread reuses: 0.04–0.08 s for the same rows, gathered and written.

``O_DIRECT`` asks for aligned buffers, offsets and lengths: the bytes are staged into the
buffer, written a whole buffer at a time, the tail padded to the alignment, and the file
cut to its size at the end. Where the file system has no ``O_DIRECT`` (tmpfs, ext4 with
``data=journal``) the same bytes are written the usual way, through the same buffer;
either way the file holds exactly the bytes given.

With a ``rate``, the writer does not run ahead of it: before each buffer goes out it waits
until the bytes already written are due (a delta spread over part of its interval, so the
disk and the cores training shares are not taken all at once). The first buffer goes out
at once, and a file of one buffer never waits. Such a writer first takes up to ``ahead``
bytes into memory as fast as they come, and only then sends them out at the rate: a
delta's rows are gathered in one burst, so the updates that go on while it is written
find them taken and keep no old values for it (kept for the whole of a spread write,
they cost training more than the write itself: W7, a delta spread over 2.5 s cost 0.48 s
of training with 8 MiB staged, 0.09-0.20 s with the whole delta, as unspread). The
staging buffer is the thread's own, reused by each file it writes (its pages stay in
memory: faulted in once, not per delta), made smaller again once a file needs under a
quarter of it, and given back (:func:`release_idle_staging`) once the thread has written
nothing through it for :data:`STAGING_IDLE_S` (a closed manager's deltas, a save long ago).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "ALIGN",
    "CHUNK",
    "MAX_AHEAD",
    "STAGING_IDLE_S",
    "DirectWriter",
    "ahead_for",
    "release_idle_staging",
    "staging_bytes",
]

#: Alignment of buffers, offsets and lengths (a page: enough for 512-byte and 4 KiB sectors).
ALIGN = 4096
#: Bytes written at a time.
CHUNK = 8 << 20
#: The most a paced writer stages ahead of its disk.
MAX_AHEAD = 1 << 30

#: A thread's staging buffer is given back after this many seconds without a file written
#: through it (a spread delta's can be up to :data:`MAX_AHEAD`).
STAGING_IDLE_S = 60.0

logger = logging.getLogger(__name__)
_buffers = threading.local()  # one staging buffer per thread, reused by each file it writes


def ahead_for(held: int) -> int:
    """The bytes a paced write of a ps holding ``held`` bytes stages ahead of its disk: at
    most a quarter of them (so its memory stays within 1.25x what it holds), as a power of
    two, at least one buffer, at most :data:`MAX_AHEAD`."""
    quarter = max(CHUNK, held // 4)
    return min(MAX_AHEAD, 1 << (quarter.bit_length() - 1))


class DirectWriter:
    """Writes the bytes given to :meth:`write` to ``fd`` (a new, empty file opened for
    writing), past the page cache where the file system allows; :meth:`finish` writes the
    tail and cuts the file to the bytes given. A file-like ``write`` for
    :func:`~pstrain._formats.files.tensor_files.write_atomically`."""

    def __init__(
        self,
        fd: int,
        rate: float | None = None,
        *,
        ahead: int = 0,
        chunk: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(
                f"DirectWriter: rate must be a positive number of bytes per second, got {rate!r}"
            )
        chunk = CHUNK if chunk is None else chunk
        if chunk <= 0 or chunk % ALIGN:
            raise ValueError(f"DirectWriter: chunk must be a positive multiple of {ALIGN}, got {chunk!r}")
        self.fd = fd
        self.size = 0
        self.fill = 0
        self.rate = rate
        self._clock, self._sleep = clock, sleep
        self._start = clock()
        self._sent = 0  # bytes handed to the file system so far
        self.direct = _set_direct(fd, True)
        #: Bytes written at a time (``CHUNK``, or less: a ps under a memory budget).
        self.chunk = chunk
        #: Bytes staged before any goes out: one chunk, or with a rate ``ahead`` rounded up
        #: to a power of two (files of about the same size reuse the same staging buffer).
        self.capacity = chunk if rate is None else max(chunk, 1 << max(0, ahead - 1).bit_length())
        self.buffer = _staging(self.capacity)
        #: Called with the file's bytes in order as they go out (the padding left out).
        self.observe: Callable[[memoryview], None] | None = None

    def write(self, data: Any) -> int:
        # Copied by numpy, which lets go of the GIL for it (a memoryview's copy holds it: 2-3
        # ms per 8 MiB during which the ps's serving loop, in the same process, waits).
        src = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        n, pos = src.size, 0
        while pos < n:
            take = min(n - pos, self.capacity - self.fill)
            np.copyto(self.buffer[self.fill : self.fill + take], src[pos : pos + take])
            self.fill += take
            self.size += take  # (before a flush: what it sends is the file's, not padding)
            pos += take
            if self.fill == self.capacity:
                self._flush(self.capacity)
        return n

    def room(self) -> np.ndarray:
        """The free part of the staging buffer: bytes put there directly (a gather into
        it, no copy of its own first) are written by :meth:`wrote`."""
        return self.buffer[self.fill : self.capacity]

    def wrote(self, n: int) -> None:
        """The first ``n`` bytes of :meth:`room` hold the file's next bytes."""
        if not 0 <= n <= self.capacity - self.fill:
            raise ValueError(f"DirectWriter.wrote: {n} bytes, with {self.capacity - self.fill} free")
        self.fill += n
        self.size += n
        if self.fill == self.capacity:
            self._flush(self.capacity)

    def finish(self) -> None:
        """Write what is staged (padded to the alignment) and cut the file to its size."""
        if self.fill:
            length = self.fill + (-self.fill % ALIGN) if self.direct else self.fill
            self.buffer[self.fill : length] = 0
            self._flush(length)
        os.ftruncate(self.fd, self.size)
        _buffers.used = time.monotonic()

    def patch(self, offset: int, data: bytes) -> None:
        """Write ``data`` over the file's bytes at ``offset``, once :meth:`finish` has
        written them all (a header's checksums: the usual way, not aligned)."""
        if self.direct:
            self.direct = _set_direct(self.fd, False)
        if os.pwrite(self.fd, data, offset) != len(data):
            raise OSError(errno.EIO, "checkpoint header patch written short")

    def _flush(self, length: int) -> None:
        """Send the first ``length`` staged bytes, a chunk at a time."""
        for lo in range(0, length, self.chunk):
            self._send(lo, min(length, lo + self.chunk))
        self.fill = 0

    def _send(self, lo: int, hi: int) -> None:
        length = hi - lo
        if self.rate is not None:
            early = self._sent / self.rate - (self._clock() - self._start)
            if early > 0:
                self._sleep(early)  # the save's own thread: the serving loop goes on meanwhile
        real = max(0, min(length, self.size - self._sent))  # the rest is the tail's padding
        self._sent += length
        chunk = self.buffer[lo:hi].data
        if self.observe is not None and real:
            self.observe(chunk[:real])
        try:
            written = os.write(self.fd, chunk)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            # the file system took O_DIRECT at open but not these writes: the usual way, then
            logger.debug("O_DIRECT writes refused (%s): writing through the page cache", exc)
            self.direct = _set_direct(self.fd, False)
            written = os.write(self.fd, chunk)
        while written < length:  # a regular file writes short only when the disk is full
            more = os.write(self.fd, chunk[written:])
            if more == 0:
                raise OSError(errno.ENOSPC, "checkpoint write made no progress")
            written += more


def _staging(size: int) -> np.ndarray:
    """This thread's staging buffer, ``size`` bytes of it: made anew when too small, or when
    over four times too big (a smaller file after a large one gives the memory back)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < size or len(buf) > 4 * size:
        buf = _buffers.buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
    _buffers.used = time.monotonic()
    return np.frombuffer(buf, np.uint8)[:size]


def release_idle_staging(idle_s: float | None = None) -> float:
    """Give back this thread's staging buffer if no file has been written through it for
    ``idle_s`` seconds (default :data:`STAGING_IDLE_S`). Returns the seconds until it may
    go if it was kept (used since, or asked a little early), 0 if it went or there was
    none. Its memory goes once the last writer using it is gone."""
    buf = getattr(_buffers, "buf", None)
    idle = STAGING_IDLE_S if idle_s is None else idle_s
    if buf is None:
        return 0.0
    left = idle - (time.monotonic() - getattr(_buffers, "used", 0.0))
    if left > 0:
        return left
    _buffers.buf = None
    return 0.0


def staging_bytes() -> int:
    """The bytes of this thread's staging buffer, 0 if it holds none."""
    buf = getattr(_buffers, "buf", None)
    return 0 if buf is None else len(buf)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; whether it is on."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | flag) if on else (flags & ~flag))
    except OSError:
        return False
    return on and bool(fcntl.fcntl(fd, fcntl.F_GETFL) & flag)
