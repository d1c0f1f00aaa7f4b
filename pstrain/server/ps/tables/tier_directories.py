"""The directories of tiered tables under ``--table-dir``, one for each ps process.

A ps makes ``pstrain-<pid>-<random>`` there and holds a lock on it (``flock``) for as
long as it lives; the kernel lets go of the lock when the process ends, however it ends.
A ps starting on the same ``--table-dir`` first removes every such directory whose lock
it can take: its ps is gone (a killed ps leaves its rows there; they come back from
checkpoints, never from that directory).

A lock, and not the process id the name carries, says whether its ps lives: ps in
containers share a ``--table-dir`` (a node's local disk mounted into each pod) from PID
namespaces of their own, where another ps's pid is no process at all (its rows would be
deleted under it) or some other process, or the ps itself (each container's first
process is pid 1: a killed ps's rows would stay for ever). A directory is made under a
hidden name, locked, then renamed into place, so no ps ever sees one unlocked while its
ps lives. A ps killed before its rename leaves its hidden directory behind (empty): a ps
starting later removes those that are over a minute old and unlocked (a ps that lives
renames its own within microseconds).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import time

from ...._base.errors import InvalidArgumentError

__all__ = ["TierDirectory"]

#: A ps's directory, once in place (the pid is for the people reading the directory).
_PLACED = re.compile(r"pstrain-[0-9]+-[0-9a-f]+")
#: A ps's directory before it is in place: the name it is made under.
_HIDDEN = re.compile(r"\.pstrain-new-[0-9a-f]+")
#: How old a hidden directory is before a ps starting takes it for a killed ps's.
HIDDEN_LEFT_S = 60.0


class TierDirectory:
    """This process's directory under ``table_dir``, locked until :meth:`remove`, after
    removing those of ps that are gone."""

    def __init__(self, table_dir: str) -> None:
        token = secrets.token_hex(4)
        hidden = os.path.join(table_dir, f".pstrain-new-{token}")
        #: Where this ps's tables keep their rows on disk.
        self.path = os.path.join(table_dir, f"pstrain-{os.getpid()}-{token}")
        self._lock: int | None = None
        try:
            os.makedirs(table_dir, exist_ok=True)
            for entry in os.listdir(table_dir):
                if _PLACED.fullmatch(entry) or (
                    _HIDDEN.fullmatch(entry) and _older_than(os.path.join(table_dir, entry), HIDDEN_LEFT_S)
                ):
                    _remove_if_gone(os.path.join(table_dir, entry))
            os.mkdir(hidden, 0o700)
            self._lock = os.open(hidden, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(hidden, self.path)
        except OSError as exc:  # (a read-only or virtual file system, a file in the way ...)
            self._close()
            shutil.rmtree(hidden, ignore_errors=True)
            raise InvalidArgumentError(
                f"table_dir {table_dir!r}: this ps cannot keep its tables' rows there: "
                f"{exc.strerror or exc} ({exc.filename or table_dir})"
            ) from None

    def remove(self) -> None:
        """Delete the directory and everything in it, then let go of its lock (once: the
        ps stops)."""
        if self._lock is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        self._close()

    def _close(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _older_than(path: str, seconds: float) -> bool:
    try:
        return os.lstat(path).st_mtime < time.time() - seconds
    except OSError:  # (gone already)
        return False


def _remove_if_gone(path: str) -> None:
    """Delete ``path``, a ps's directory, if its lock can be taken (its ps is gone), holding
    the lock meanwhile (another ps starting now leaves it alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # (gone already: another ps removed it; or not a directory: not ours)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # (held: its ps lives)
        os.close(fd)
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
