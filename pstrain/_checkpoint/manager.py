"""Numbered checkpoints in one directory, kept to a number, with deltas between them.

``CheckpointManager(ckpt, directory, max_to_keep=5)`` is TF's: ``save()`` writes
``<directory>/<checkpoint_name>-<N>`` and drops the oldest past ``max_to_keep``;
``restore_or_initialize()`` restores the latest.

With ``delta_interval_s``, it also writes a *delta* every that many seconds while
the program runs (from the first ``save()`` or ``restore_or_initialize()`` on):
``<checkpoint_name>-<N>.delta-<K>``, the rows changed since the save before
(``_checkpoint/deltas.py``), so a job killed at any moment loses at most about one
interval of updates, not one full-save interval. ``latest_checkpoint`` names the
newest delta of the newest full checkpoint, and restoring it applies base + deltas.
After ``deltas_per_base`` deltas the next tick *compacts*: it writes a full
checkpoint (training goes on; deltas keep extending the old one until the new one's
index is written, and that index is written after the new one's first delta, so the
newest save is never older than about one interval), which becomes the base of the
next deltas; old full checkpoints go with their deltas. A delta that cannot be
written (a ps restarted since the base) is replaced by a full save; one that fails
is logged and its rows go into the next. ``await manager.close()`` stops the deltas, after the one being
written if there is one (``asyncio.run`` cancels them when the program ends).
Each delta is spread: its ps gathers the rows at once (up to a quarter of what it holds,
in memory), then writes the file over ``delta_write_s`` seconds (by default a quarter of
the interval), so training keeps its speed meanwhile. The manager starts each delta that
much before it is due, so it lands on the interval and a kill still loses at most about
one interval; ``delta_write_s=0`` writes as fast as the disk goes
(``docs/failures-and-checkpoints.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import inspect
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

from .._base.checks import number, whole
from .._base.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from .._base.exports import expose
from .._formats.files.checkpoint_files import INDEX, remove_checkpoint
from .._formats.files.delta_files import delta_prefix, split_delta
from .._formats.files.tensor_files import write_atomically
from .._variables.variables import Variable
from . import kept
from .checkpoint import Checkpoint
from .deltas import check_write_s

logger = logging.getLogger("pstrain.checkpoint")

__all__ = ["CheckpointManager", "latest_checkpoint"]

#: The share of ``delta_interval_s`` a delta is spread over unless ``delta_write_s`` is given.
DELTA_WRITE_SHARE = 0.25


class CheckpointManager:
    """Numbered checkpoints ``<directory>/<checkpoint_name>-<N>`` keeping the last
    ``max_to_keep``; with ``delta_interval_s``, deltas between them (module docstring).

    As TF's: with ``step_counter`` (a variable, such as ``optimizer.iterations``) and
    ``checkpoint_interval``, :meth:`save` saves only once the step has moved that many
    steps past the last save (``check_interval=False``: whenever the step moved), and
    returns None otherwise; :meth:`restore_or_initialize` restores the newest save, or
    calls ``init_fn`` when there is none. With ``keep_checkpoint_every_n_hours``, a save
    that leaves the ``max_to_keep`` kept is preserved instead of deleted if it was written at
    least that many hours after the last one preserved (or after this manager was made):
    it stays on disk for good (no manager in the directory deletes it, whatever its
    settings) and leaves :attr:`checkpoints`, as TF's. Which saves are preserved is
    recorded in ``<checkpoint_name>.preserved.json`` beside them; a save's time is its
    index file's.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        *,
        delta_interval_s: float | None = None,
        deltas_per_base: int = 10,
        delta_write_s: float | None = None,
        step_counter: Variable | None = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if checkpoint_interval is not None:
            checkpoint_interval = whole(checkpoint_interval, "checkpoint_interval (None: save every time)", 1)
            if step_counter is None:
                raise InvalidArgumentError(
                    "`step_counter` should be passed if `checkpoint_interval` is not None."
                )
        if step_counter is not None and not isinstance(step_counter, Variable):
            raise InvalidArgumentError(
                "step_counter must be a pstrain.Variable (optimizer.iterations, say), "
                f"got {type(step_counter).__name__}"
            )
        if init_fn is not None and not callable(init_fn):
            raise InvalidArgumentError(f"init_fn must be callable, got {type(init_fn).__name__}")
        if max_to_keep is not None:
            max_to_keep = whole(max_to_keep, "max_to_keep (None keeps all)", 1)
        if keep_checkpoint_every_n_hours is not None:
            keep_checkpoint_every_n_hours = number(
                keep_checkpoint_every_n_hours,
                "keep_checkpoint_every_n_hours (None preserves none)",
                above=True,
                unit=" of hours",
            )
        if delta_interval_s is not None:
            delta_interval_s = number(
                delta_interval_s, "delta_interval_s (None: no deltas)", above=True, unit=" of seconds"
            )
        deltas_per_base = whole(deltas_per_base, "deltas_per_base", 1)
        if not isinstance(checkpoint_name, str) or not checkpoint_name:
            raise InvalidArgumentError(
                f"checkpoint_name must be a string that is not empty, got {checkpoint_name!r}"
            )
        if delta_write_s is None:
            delta_write_s = DELTA_WRITE_SHARE * delta_interval_s if delta_interval_s else 0.0
        check_write_s(delta_write_s, "delta_write_s")
        if delta_interval_s is not None and delta_write_s > delta_interval_s / 2:
            raise InvalidArgumentError(
                f"delta_write_s ({delta_write_s!r}) must be at most half "
                f"of delta_interval_s ({delta_interval_s!r}): each delta "
                "starts that much early to land on the interval"
            )
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise InvalidArgumentError(f"CheckpointManager: {directory} is a file, not a directory")
        self.checkpoint = checkpoint
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.keep_checkpoint_every_n_hours = keep_checkpoint_every_n_hours
        self.checkpoint_name = checkpoint_name
        preserved_at, self._preserved = _preserved(self.directory, checkpoint_name)
        now = time.time()
        # As TF: from a second before now, or the last preserved save (never in the future).
        self._last_preserved = now - 1.0 if preserved_at is None else min(preserved_at, now)
        self.delta_interval_s = delta_interval_s
        self.deltas_per_base = deltas_per_base
        self.delta_write_s = float(delta_write_s)
        self.step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step: int | None = None  # the step of the last save (with an interval)
        self._loop: asyncio.Task[None] | None = None
        self._closed = False  # close() stops the deltas for good
        self._compaction: asyncio.Task[str] | None = None
        #: After a compaction failed (a full disk): its base, and how many deltas of it the
        #: next try waits for (each try of a large base writes until the disk is full again).
        self._compact_later: tuple[str, int] | None = None
        self._waiting = False  # the deltas' loop waits for its next tick (close() cancels it then)
        self._lock = asyncio.Lock()  # one full save at a time
        self._hurry = asyncio.Event()  # set by close(): a spread delta under way goes at once
        kept.track(self)  # Ctrl-C says which checkpoint was kept

    def _numbers(self) -> list[int]:
        """The numbers of the saves this manager keeps to ``max_to_keep`` (not the preserved)."""
        return [n for n in _numbers(self.directory, self.checkpoint_name) if n not in self._preserved]

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, f"{self.checkpoint_name}-{number}")

    def _deltas(self, base: str) -> int:
        return _deltas(base)

    @property
    def checkpoints(self) -> list[str]:
        """The complete full checkpoints kept to ``max_to_keep``, oldest first (those
        preserved by ``keep_checkpoint_every_n_hours`` are not among them, as in TF)."""
        return [self._path(n) for n in self._numbers()]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest state saved: the newest delta of the newest full checkpoint, if it has
        any, else that checkpoint; None if there is none."""
        return _newest(self.directory, self.checkpoint_name)

    @property
    def checkpoint_interval(self) -> int | None:
        """The least number of steps between two saves (None: every :meth:`save` saves)."""
        return self._checkpoint_interval

    async def save(
        self,
        checkpoint_number: int | Variable | None = None,
        check_interval: bool = True,
        options: Any = None,
    ) -> str | None:
        """Save the next full checkpoint (or number ``checkpoint_number``: a number, or an
        integer variable whose value it is) and drop old ones; returns its path, or None when
        ``checkpoint_interval`` says it is too soon (TF's rule, in the class docstring).
        ``options`` (TF's ``CheckpointOptions``) has no effect."""
        if self._checkpoint_interval is not None:
            assert self.step_counter is not None
            step = int(await self.step_counter.numpy())
            last = self._last_checkpoint_step
            if last is not None and (
                step == last or (check_interval and step < last + self._checkpoint_interval)
            ):
                return None
            self._last_checkpoint_step = step
        if isinstance(checkpoint_number, Variable):
            checkpoint_number = int(await checkpoint_number.numpy())
        elif checkpoint_number is not None:
            checkpoint_number = whole(checkpoint_number, "checkpoint_number", 0)
        return await self._save(checkpoint_number, compacted=False)

    async def restore_or_initialize(self) -> str | None:
        """Restore the newest save (a delta's, if there are deltas) and return its path; with
        none, call ``init_fn`` (awaited if it is a coroutine function) and return None. With
        ``delta_interval_s``, the deltas start from here."""
        latest = self.latest_checkpoint
        if latest is not None:
            await self.checkpoint.restore(latest)
            if self._checkpoint_interval is not None:
                assert self.step_counter is not None
                self._last_checkpoint_step = int(await self.step_counter.numpy())
        elif self._init_fn is not None:
            done = self._init_fn()
            if inspect.isawaitable(done):
                await done
            logger.info("Customized initialization is done through the passed `init_fn`.")
        self._start()
        return latest

    async def _save(self, checkpoint_number: int | None, compacted: bool) -> str:
        async with self._lock:
            numbers = _numbers(self.directory, self.checkpoint_name)  # (preserved ones too)
            number = (
                checkpoint_number if checkpoint_number is not None else (numbers[-1] + 1 if numbers else 1)
            )
            self.checkpoint.save_counter = max(self.checkpoint.save_counter, number)
            write = self.checkpoint.write_compacted if compacted else self.checkpoint.write
            # With deltas under way, the new one becomes visible with its first delta: no older
            # than the deltas that went on while it was written (seconds, for a large model).
            catch_up = self.delta_interval_s is not None and self.checkpoint.chain_base is not None
            path = await write(self._path(number), catch_up=catch_up)
            if self.max_to_keep is not None:
                for old in self._numbers()[: -self.max_to_keep]:
                    if not self._preserve(old):
                        self._delete(old)
        self._start()
        return path

    def _preserve(self, number: int) -> bool:
        """Keep save ``number`` for good, leaving the kept ones, if it was written at least
        ``keep_checkpoint_every_n_hours`` after the last one preserved (TF's rule). Recorded
        before anything is deleted."""
        hours = self.keep_checkpoint_every_n_hours
        if hours is None:
            return False
        try:
            written = os.stat(self._path(number) + INDEX).st_mtime
        except FileNotFoundError:
            return False
        if written - hours * 3600.0 < self._last_preserved:
            return False
        self._preserved.add(number)
        self._last_preserved = written
        _record_preserved(self.directory, self.checkpoint_name, written, self._preserved)
        logger.info("checkpoint %s preserved (keep_checkpoint_every_n_hours=%g)", self._path(number), hours)
        return True

    async def save_delta(self) -> str:
        """Write a delta on the newest full checkpoint (a full save instead if there is none
        this process wrote or restored, or a ps restarted since); returns its path."""
        base = self.checkpoint.chain_base  # (the checkpoint writes one delta at a time)
        if base is None or os.path.dirname(base) != self.directory or not os.path.exists(base + INDEX):
            path = None
        else:
            try:
                path = await self.checkpoint.write_delta(write_s=self.delta_write_s, hurry=self._hurry)
            except FailedPreconditionError as exc:
                logger.warning("writing a full checkpoint instead of a delta: %s", exc)
                path = None
        if path is None:  # (a full save now, whatever checkpoint_interval says)
            return await self._save(None, compacted=False)
        split = split_delta(path)
        if split and not os.path.exists(split[0] + INDEX):  # its base was dropped meanwhile
            remove_checkpoint(path)
            return self.latest_checkpoint or path
        self._start()
        return path

    async def compact(self) -> str:
        """Fold the deltas into a new full checkpoint (training goes on meanwhile).

        A delta is written first and the new base covers the changes up to it, so a table
        feed reader that has that delta follows the new base's deltas without a full read."""
        if self.checkpoint.chain_base is not None:
            written = await self.save_delta()
            if split_delta(written) is None:  # it became a full save (a ps restarted, say)
                return written
        return await self._save(None, compacted=True)

    def _start(self) -> None:
        if self.delta_interval_s is not None and self._loop is None and not self._closed:
            self._loop = asyncio.get_running_loop().create_task(self._deltas_loop(), name="pstrain-deltas")

    async def _deltas_loop(self) -> None:
        assert self.delta_interval_s is not None
        # A delta captures the rows when it starts and lands delta_write_s later: starting
        # each that much early keeps the newest delta on disk at most one interval old.
        period = self.delta_interval_s - self.delta_write_s
        due = time.monotonic() + period
        while not self._closed:
            self._waiting = True
            try:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            finally:
                self._waiting = False
            due = max(due + period, time.monotonic())
            try:
                base = self.checkpoint.chain_base
                if base is not None and self._compaction is None and self._compact_now(base):
                    self._compaction = asyncio.get_running_loop().create_task(self.compact())
                    self._compaction.add_done_callback(functools.partial(self._compacted, base))
                await self.save_delta()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next delta carries these rows too
                logger.warning("delta checkpoint failed (the next one carries its rows): %s", exc)

    def _compact_now(self, base: str) -> bool:
        """Whether the deltas of ``base`` are enough to compact: ``deltas_per_base`` of them,
        and as many more again after each failed try on that base."""
        later = self._compact_later
        wanted = later[1] if later is not None and later[0] == base else self.deltas_per_base
        return self._deltas(base) >= wanted

    def _compacted(self, base: str, task: asyncio.Task[str]) -> None:
        self._compaction = None
        if not task.cancelled() and task.exception() is not None:
            retry = self._deltas(base) + self.deltas_per_base
            self._compact_later = (base, retry)
            logger.warning(
                "compacting the deltas into a full checkpoint failed (tried again after delta "
                "%d; the deltas go on meanwhile): %s",
                retry,
                task.exception(),
            )

    @property
    def writing_deltas(self) -> bool:
        """Whether deltas are being written every ``delta_interval_s`` (on this loop)."""
        loop = self._loop
        return (
            loop is not None
            and not self._closed
            and not loop.done()
            and loop.get_loop() is asyncio.get_running_loop()
        )

    async def keep(self) -> str:
        """Stop the deltas and write a last one of what is done now, at once (``pstrain.run``
        does this on Ctrl-C once the steps in flight have finished); returns its path."""
        await self.close()
        return await self.save_delta()

    async def close(self) -> None:
        """Stop writing deltas for good. A delta or compaction under way is let finish (one
        cancelled half-way leaves a ps writing a file the next save of its name then meets),
        its ps told to write the rest of a spread delta at once."""
        self._closed = True
        self._hurry.set()
        loop, self._loop = self._loop, None
        if loop is not None:
            if self._waiting:
                loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        if self._compaction is not None:
            await asyncio.gather(self._compaction, return_exceptions=True)

    def _delete(self, number: int) -> None:
        remove_checkpoint(self._path(number))  # with its deltas


def latest_checkpoint(checkpoint_dir: str, latest_filename: str | None = None) -> str | None:
    """TF's ``tf.train.latest_checkpoint``: the path of the newest state saved in
    ``checkpoint_dir`` by a :class:`CheckpointManager` or ``Checkpoint.save`` (the newest
    delta of the highest-numbered save, as ``CheckpointManager.latest_checkpoint``), or
    None when there is none. With saves of several names (``ckpt-3``, ``other-7``), the
    name whose newest save was written last. ``latest_filename`` (TF's state file) is
    accepted: pstrain keeps no state file, the saves are found by their names."""
    directory = os.path.abspath(checkpoint_dir)
    if not os.path.isdir(directory):
        return None
    names = {
        m.group(1)
        for p in os.listdir(directory)
        if (m := _FULL.fullmatch(p)) and split_delta(os.path.join(directory, p.removesuffix(INDEX))) is None
    }
    newest = [path for name in names if (path := _newest(directory, name)) is not None]
    if not newest:
        return None
    return max(newest, key=lambda path: (os.stat(path + INDEX).st_mtime_ns, path))


#: A full save's index file: ``<name>-<N>.index.json`` (a delta's name holds ``.delta-``).
_FULL = re.compile(r"(.+)-([0-9]+)" + re.escape(INDEX))


def _preserved_file(directory: str, name: str) -> str:
    return os.path.join(directory, f"{name}.preserved.json")


def _preserved(directory: str, name: str) -> tuple[float | None, set[int]]:
    """When the last save of ``name`` was preserved (None: never), and the numbers of those
    preserved, from the record beside them. A record that cannot be read is an error: the
    saves it names must not be taken for ones to delete."""
    path = _preserved_file(directory, name)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        at, numbers = record["last_preserved_timestamp"], record["preserved"]
        if not isinstance(at, (int, float)) or not all(isinstance(n, int) and n >= 0 for n in numbers):
            raise ValueError("bad types")
    except FileNotFoundError:
        return None, set()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataLossError(
            f"CheckpointManager: {path} (the saves keep_checkpoint_every_n_hours preserved) "
            f"cannot be read ({exc}); fix or remove it"
        ) from None
    return float(at), set(numbers)


def _record_preserved(directory: str, name: str, at: float, numbers: set[int]) -> None:
    record = {"last_preserved_timestamp": at, "preserved": sorted(numbers)}
    data = (json.dumps(record) + "\n").encode()
    write_atomically(_preserved_file(directory, name), lambda f: f.write(data))


def _numbers(directory: str, name: str) -> list[int]:
    """The numbers of the complete full saves of ``name`` in ``directory``, ascending."""
    pattern = re.compile(re.escape(name) + r"-([0-9]+)" + re.escape(INDEX) + "$")
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{glob.escape(name)}-*{INDEX}")):
        m = pattern.search(os.path.basename(path))
        if m:
            found.append(int(m.group(1)))
    return sorted(found)


def _deltas(base: str) -> int:
    """How many deltas of ``base`` exist, in order from 1."""
    k = 0
    while os.path.exists(delta_prefix(base, k + 1) + INDEX):
        k += 1
    return k


def _newest(directory: str, name: str) -> str | None:
    """The newest delta of the newest full save of ``name``, or that save; None: none."""
    numbers = _numbers(directory, name)
    if not numbers:
        return None
    base = os.path.join(directory, f"{name}-{numbers[-1]}")
    k = _deltas(base)
    return delta_prefix(base, k) if k else base


expose(globals(), "pstrain.checkpoint")
