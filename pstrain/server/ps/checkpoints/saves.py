"""The ps's side of checkpoints: files under one root, restores staged then committed.

``ckpt/save`` writes the named variables to one safetensors file. The path
must lie under the ps's *checkpoint root* (``pstrain serve
--checkpoint-root``, default the directory the ps was started in); absolute
paths elsewhere and ``..`` are refused. The file is written under an
exclusive, unpredictable temporary name in the same directory, fsynced, then
linked to its final name, which must not exist yet; the temporary file is
removed whatever happens. Training goes on meanwhile: a large array is read
through a :class:`~pstrain.server.ps.store.Snapshot` (block by block; an update
keeps the old values of the rows it changes until the writer has passed
them), a small one is pinned (an update copies it first). Either way the
file holds each array as it was when the save began.

``ckpt/restore`` builds variables from row ranges of checkpoint files (a
sharded variable may have been saved in a different number of parts). Every
source must be a file under the root, and the sources of a variable must be
disjoint and cover every row, before anything is read. With a ``stage`` id the
arrays are held until ``ckpt/commit`` puts them in place (or ``ckpt/abort``
drops them): the coordinator stages on every ps, then commits, so a restore
that fails on one ps changes none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ...._base.errors import AlreadyExistsError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from ...._formats.files import direct_writes
from ...._formats.files.checkpoint_files import unwritten
from ...._formats.files.delta_files import TablePlan, read_table_plan
from ...._formats.files.tensor_files import SAFETENSORS_DTYPES, read_rows, whole, write_streaming
from ...._formats.messages.checkpoint_operations import RestoreCheckpoint, RestoreSpec, SaveCheckpoint
from ...._formats.messages.records import RestoreReply
from ...._formats.numerics.idhash import Shard
from ..store import VariableRecord, VariableStore
from .snapshots import BLOCK_BYTES

__all__ = ["CheckpointFiles", "Pending"]

Tensors = list[tuple[str, np.dtype, tuple[int, ...], Any]]
#: Tensors as ``write_streaming`` takes them, or what makes them on the save thread.
SomeTensors = Tensors | Callable[[], Tensors]

logger = logging.getLogger(__name__)

#: Staged restores not committed within this many seconds are dropped.
STAGE_TTL_S = 300.0
#: Restores staged (read, not yet committed) at once on one ps.
MAX_STAGED = 4


@dataclasses.dataclass
class Pending:
    """A checkpoint file taken (checked, its values snapshotted), not yet written."""

    path: str  # as asked
    real: str  # resolved, under the root
    tensors: SomeTensors
    releases: list[Callable[[], None]]
    #: Files the file links (``_formats/files/table_links.py``): ``(source, link)``, each
    #: link made before the file is written (and removed if it is not).
    links: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def release(self) -> None:
        for release in self.releases:
            release()
        self.releases = []


class CheckpointFiles:
    """Checkpoint files of one ps, confined to ``root``."""

    def __init__(
        self,
        store: VariableStore,
        root: str | None = None,
        max_variable_bytes: int | None = None,
        max_store_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.max_variable_bytes = max_variable_bytes  # a restored variable's limit, as a created one
        self.max_store_bytes = max_store_bytes  # bytes held at most (the ps's --max-store-bytes)
        #: The spread writes under way, each with the event that sends its rest at once
        #: (:meth:`hurry`); once the ps stops, every write goes at once (the process would
        #: otherwise wait out a schedule before it exits).
        self._spreading: set[threading.Event] = set()
        self.stopped = False
        #: The most bytes a save stages at a time: a ps under a memory budget stages a
        #: share of it (``Tiering.save_bytes``), not ``CHUNK`` nor a quarter of what it
        #: holds (a spread delta's ``ahead``); None: no budget.
        self.staging: int | None = None
        #: Per save thread, the check that gives its staging buffer back once it is idle.
        self._idle_checks: dict[str, asyncio.TimerHandle] = {}
        self.root = os.path.realpath(root or os.getcwd())
        #: stage -> (the values read, the variables whose initial values it released, the
        #: timer that drops it when STAGE_TTL_S is up; cancelled by a commit or an abort)
        self._staged: dict[
            str,
            tuple[list[tuple[str, np.ndarray, bool, str | None]], list[VariableRecord], asyncio.TimerHandle],
        ] = {}
        self._reading = 0  # bytes of the restores being read now
        store.staged.append(self.staged_bytes)

    @property
    def block_bytes(self) -> int:
        """The bytes a save copies out of an array at a time (:data:`BLOCK_BYTES`, or its
        staging under a budget)."""
        return BLOCK_BYTES if self.staging is None else min(BLOCK_BYTES, self.staging)

    def confine(self, path: str, what: str) -> str:
        """``path`` resolved, if it lies under the root; else InvalidArgumentError."""
        if "\x00" in path or not os.path.isabs(path):
            raise InvalidArgumentError(
                f"{what} {path!r}: give an absolute path under this ps's checkpoint root {self.root}"
            )
        if ".." in path.split(os.sep):
            raise InvalidArgumentError(f"{what} {path!r}: '..' is not allowed in checkpoint paths")
        real = os.path.realpath(path)
        if real != self.root and not real.startswith(self.root + os.sep):
            raise InvalidArgumentError(
                f"{what} {path!r} is outside this ps's checkpoint root {self.root} "
                "(pstrain serve --checkpoint-root)"
            )
        return real

    # -- save ------------------------------------------------------------------------------------
    def take(self, path: str, tensors: SomeTensors) -> Pending:
        """A new file ``path`` under the root to hold ``tensors`` (as ``write_streaming``
        takes them): checked, not written; snapshots added to its ``releases`` end once it is."""
        real = self.confine(path, "checkpoint file")
        if os.path.lexists(real):
            raise AlreadyExistsError(
                f"checkpoint file {path} already exists; a checkpoint is never written over"
            )
        if not os.path.isdir(os.path.dirname(real)):
            raise NotFoundError(
                f"checkpoint directory {os.path.dirname(path)} does not exist on {self.store.task}"
            )
        return Pending(path, real, tensors, [])

    def take_variables(self, req: SaveCheckpoint) -> Pending:
        """``req``'s variables as they are now: large ones through snapshots (read block by
        block while updates go on, never copied whole), small ones pinned."""
        tensors: Tensors = []
        pending = self.take(req.path, tensors)
        records = {key: self.store.get(name) for key, name in req.tensors.items()}
        for r in records.values():
            if r.array.dtype.name not in SAFETENSORS_DTYPES:
                raise InvalidArgumentError(
                    f"ckpt/save: {r.name!r} has dtype {r.array.dtype}, which a checkpoint cannot hold"
                )
        try:
            for key, r in records.items():
                arr = r.array
                snap = r.snapshot(block_bytes=self.block_bytes)
                if snap is not None:
                    pending.releases.append(functools.partial(r.end_snapshot, snap))
                    tensors.append((key, arr.dtype, arr.shape, snap))
                else:
                    pending.releases.append(r.pin())
                    tensors.append(whole(key, arr))
        except BaseException:
            pending.release()
            raise
        return pending

    async def write(
        self, pending: Pending, kind: str = "full", write_s: float = 0.0, ahead: int = 0
    ) -> dict[str, Any]:
        """Write what :meth:`take` checked, on the save thread of its ``kind`` (spread over
        about ``write_s`` seconds if > 0, up to ``ahead`` bytes taken in first); its
        snapshots end after."""
        pace = threading.Event()
        if write_s > 0:
            self._spreading.add(pace)
            if self.stopped:
                pace.set()

        def run() -> int:  # until the file is written, even if the request is cancelled
            made: list[str] = []
            try:
                for source, link in pending.links:  # (the file names them: they come first)
                    make_link(source, link, pending.path)
                    made.append(link)
                size = write_streaming(
                    pending.real,
                    pending.tensors,
                    root=self.root,
                    write_s=write_s,
                    ahead=ahead if self.staging is None else min(ahead, self.staging),
                    sleep=pace.wait,
                    chunk=self.staging,
                )
                made.clear()
                return size
            finally:
                self._spreading.discard(pace)
                for link in made:  # the file was not written: nothing names them
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(link)

        try:
            size = await asyncio.get_running_loop().run_in_executor(_save_thread(kind), run)
        except OSError as exc:  # (the file written is removed: nothing names it)
            raise unwritten(pending.path, exc) from None
        finally:
            pending.release()
            self._release_when_idle(kind)
        return {"path": pending.path, "bytes": size}

    def _release_when_idle(self, kind: str, after: float | None = None) -> None:
        """Have the save thread of ``kind`` give its staging buffer back (up to 1 GiB for a
        spread delta) if it writes nothing more for ``STAGING_IDLE_S`` seconds: after the
        last delta of a closed manager, or a save long ago, it is not held for nothing. A
        check that finds it used too recently (since, or by a timer a little early) comes
        again when it may go (``after`` seconds), rather than leave it held for good."""
        if (old := self._idle_checks.pop(kind, None)) is not None:
            old.cancel()
        loop = asyncio.get_running_loop()

        def check() -> None:
            self._idle_checks.pop(kind, None)
            with contextlib.suppress(RuntimeError):  # the thread's pool shut down: exiting
                _save_thread(kind).submit(direct_writes.release_idle_staging).add_done_callback(again)

        def again(done: concurrent.futures.Future[float]) -> None:  # on the save thread
            if not done.cancelled() and done.exception() is None and done.result() > 0:
                with contextlib.suppress(RuntimeError):  # the loop closed: exiting
                    loop.call_soon_threadsafe(self._release_when_idle, kind, done.result())

        self._idle_checks[kind] = loop.call_later(
            direct_writes.STAGING_IDLE_S if after is None else after, check
        )

    def hurry(self, stop: bool = False) -> int:
        """Send the rest of every spread write under way at once (and of every later one, if
        ``stop``: the ps is stopping); returns how many were under way."""
        self.stopped = self.stopped or stop
        for pace in list(self._spreading):  # (the save threads take theirs out as they end)
            pace.set()
        return len(self._spreading)

    async def save_streamed(
        self, path: str, tensors: SomeTensors, write_s: float = 0.0, ahead: int = 0
    ) -> dict[str, Any]:
        """Write ``tensors`` (a delta's, as ``write_streaming`` takes them, or a function the
        save thread calls for them) to a new file under the root, on the deltas' save thread,
        spread over about ``write_s`` seconds if > 0 (up to ``ahead`` bytes gathered first)."""
        return await self.write(self.take(path, tensors), "delta", write_s, ahead)

    def _table_files(
        self, paths: list[str], deltas: list[list[tuple[str, str]]] | None
    ) -> tuple[list[str], list[list[tuple[str, str]]]]:
        """A table's base files and its deltas' ``(file, prefix)`` pairs, confined to the
        checkpoint root (InvalidArgumentError for one outside it)."""
        real = [self.confine(p, "dyn/restore: file") for p in paths]
        real_deltas = [
            [(self.confine(p, "dyn/restore: delta file"), prefix) for p, prefix in delta]
            for delta in deltas or []
        ]
        return real, real_deltas

    async def read_table_plan(
        self,
        paths: list[str],
        shard: Shard,
        num_shards: int,
        dim: int,
        dtype: np.dtype,
        deltas: list[list[tuple[str, str]]] | None = None,
    ) -> TablePlan:
        """The rows of a saved dynamic table that shard ``shard`` of ``num_shards`` holds,
        planned, not read (``delta_files.read_table_plan``: the base's ids, each delta of
        ``deltas`` composed; a restore then reads the rows it has room for, into RAM or to
        a tiered shard's disk, a piece at a time)."""
        real, real_deltas = self._table_files(paths, deltas)
        return await asyncio.to_thread(read_table_plan, real, real_deltas, shard, num_shards, dim, dtype)

    # -- restore -----------------------------------------------------------------------------------
    def _check_sources(
        self, spec: RestoreSpec
    ) -> tuple[tuple[int, ...], np.dtype, list[list[Any]], list[list[Any]]]:
        where = f"ckpt/restore {spec.name!r}"
        try:
            dtype = np.dtype(spec.dtype)
        except TypeError as exc:
            raise InvalidArgumentError(f"{where}: bad dtype {spec.dtype!r}") from exc
        if dtype.kind not in "biufc":
            raise InvalidArgumentError(f"{where}: dtype {dtype} is not numeric")
        shape = tuple(spec.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if self.max_variable_bytes is not None and nbytes > self.max_variable_bytes:
            raise InvalidArgumentError(
                f"{where}: {shape} {dtype} is {nbytes} bytes, more than this ps's limit of "
                f"{self.max_variable_bytes} bytes per variable (pstrain serve --max-variable-bytes)"
            )
        rows = shape[0] if shape else 1
        sources = []
        covered: list[tuple[int, int]] = []
        for file, key, start, stop, dst in spec.sources:
            real = self.confine(file, f"{where}: file")
            if start is None:
                if stop is not None or dst is not None or len(spec.sources) != 1:
                    raise InvalidArgumentError(f"{where}: a whole-tensor source must be the only one")
                covered.append((0, rows))
            else:
                if not shape:
                    raise InvalidArgumentError(f"{where}: a scalar has no rows to read a range of")
                if stop is None or dst is None or stop <= start:
                    raise InvalidArgumentError(f"{where}: bad row range {start}..{stop} -> {dst}")
                covered.append((dst, dst + (stop - start)))
            sources.append([real, key, start, stop, dst])
        covered.sort()
        pos = 0
        for lo, hi in covered:
            if lo != pos:
                what = "overlap" if lo < pos else f"leave rows {pos}..{lo} uncovered"
                raise InvalidArgumentError(f"{where}: the sources {what}")
            pos = hi
        if pos != rows:
            raise InvalidArgumentError(f"{where}: the sources cover {pos} of {rows} rows")
        patches = [
            [self.confine(file, f"{where}: delta file"), rows_key, idx_key, shift]
            for file, rows_key, idx_key, shift in spec.patches
        ]
        return shape, dtype, sources, patches

    async def restore(self, req: RestoreCheckpoint) -> RestoreReply:
        checked = [(spec, *self._check_sources(spec)) for spec in req.vars]  # all, before any read
        names = [spec.name for spec, *_ in checked]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("ckpt/restore: a variable is named twice")
        adding = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, *_ in checked)
        if self.max_store_bytes is not None:  # read values sit beside the live ones until commit
            held = self.store.held()
            if held + adding > self.max_store_bytes:
                raise ResourceExhaustedError(
                    f"ckpt/restore: reading {adding} bytes would take {self.store.task} past its "
                    f"limit of {self.max_store_bytes} bytes held ({held} held now; pstrain serve "
                    "--max-store-bytes)"
                )
        in_place = [  # variables whose values the restore replaces
            record
            for spec, shape, dtype, *_ in checked
            if (record := self.store.find(spec.name)) is not None
            and (record.shape, record.dtype) == (shape, dtype)
        ]
        self.store.check_budget(  # initial values give their memory to the values read
            adding - sum(r.nbytes for r in in_place if r.initial is not None),
            f"ckpt/restore of {', '.join(repr(n) for n in names)}",
        )

        if req.stage is not None:  # refused before anything is read or released
            self._room_to_stage()
        # initial values the restore replaces: their memory back now, not beside the values read
        released = [record for record in in_place if record.release_initial()]

        def build() -> list[tuple[str, np.ndarray, bool, str | None]]:
            return [
                (spec.name, read_rows(shape, dtype, sources, patches), spec.trainable, spec.slot_of)
                for spec, shape, dtype, sources, patches in checked
            ]

        self._reading += adding  # (counted as held while read: restores of tables come too)
        try:
            built = await asyncio.to_thread(build)  # in this context: its allocator
            self._check_fits(built)
            if req.stage is not None:  # again: others may have staged while this one read
                self._room_to_stage()
        except BaseException:
            await remake_initial(released)
            raise
        finally:
            self._reading -= adding  # (staged or put in the store next, with no await between)
        if req.stage is not None:
            self._take_stage(req.stage)  # (a stage named again replaces the first)
            # a coordinator that stopped between staging and commit: not held for good (the
            # timer holds the name only: a stage ended sooner is not kept alive by it)
            timer = asyncio.get_running_loop().call_later(STAGE_TTL_S, self._staged.pop, req.stage, None)
            self._staged[req.stage] = (built, released, timer)
            return RestoreReply(staged=len(built), stage=req.stage)
        self._put(built)
        return RestoreReply(restored=len(built))

    def _room_to_stage(self) -> None:
        if len(self._staged) >= MAX_STAGED:
            raise InvalidArgumentError(
                f"ckpt/restore: {len(self._staged)} restores are staged on {self.store.task} "
                f"already (at most {MAX_STAGED}, each kept {STAGE_TTL_S:g} s until committed "
                "or aborted): commit or abort them first"
            )

    def _check_fits(self, built: list[tuple[str, np.ndarray, bool, str | None]]) -> None:
        for name, array, *_ in built:
            record = self.store.find(name)
            if record is not None and (record.shape != array.shape or record.dtype != array.dtype):
                raise InvalidArgumentError(
                    f"checkpoint value for {name!r} is {array.shape} {array.dtype}, the variable "
                    f"is {record.shape} {record.dtype}"
                )

    def _put(self, built: list[tuple[str, np.ndarray, bool, str | None]]) -> None:
        for name, array, trainable, slot_of in built:
            self.store.put(name, array, trainable, slot_of)

    def has_stage(self, stage: str) -> bool:
        """Whether variables are staged as ``stage``."""
        return stage in self._staged

    def commit(self, stage: str) -> int:
        """Put a staged restore in place (all its variables at once)."""
        entry = self._take_stage(stage)
        if entry is None:
            raise NotFoundError(
                f"no staged restore {stage!r} on {self.store.task} (it expired "
                f"after {STAGE_TTL_S:g} s, or was aborted)"
            )
        built = entry[0]
        self._check_fits(built)
        self._put(built)
        return len(built)  # restored

    async def abort(self, stage: str) -> bool:
        entry = self._take_stage(stage)
        if entry is not None:
            await remake_initial(entry[1])
        return entry is not None  # aborted

    def staged_bytes(self) -> int:
        """Bytes held by restores being read, and staged and not yet committed."""
        return self._reading + sum(a.nbytes for built, *_ in self._staged.values() for _, a, *_ in built)

    def _take_stage(self, stage: str) -> tuple[Any, ...] | None:
        """Stage ``stage`` taken out (committed or aborted), its timer cancelled. One the
        timer drops instead leaves the initial values it released to be made when next read."""
        entry = self._staged.pop(stage, None)
        if entry is not None:
            entry[2].cancel()
        return entry


_SAVERS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def make_link(source: str, link: str, path: str) -> None:
    """Hard-link ``source`` (a file of a tier, held while the save runs) as ``link``, beside
    checkpoint file ``path``; AlreadyExistsError if ``link`` exists. The directory is
    fsynced with the file written after it."""
    try:
        os.link(source, link, follow_symlinks=False)
    except FileExistsError:
        raise AlreadyExistsError(
            f"checkpoint file {link} (a link of {path}) already exists; a checkpoint is never written over"
        ) from None
    except OSError as exc:
        raise InvalidArgumentError(f"checkpoint {path}: cannot link {source} as {link}: {exc}") from exc


def _save_thread(kind: str = "full") -> concurrent.futures.ThreadPoolExecutor:
    """The thread that writes saves of ``kind``, one of each per process, made at the first
    such save: ``"full"`` checkpoints and deltas (``"delta"``), so that a delta (which bounds what a
    SIGKILL loses) is not held up behind a compaction's full write. Each runs at the
    serving loop's priority: a nicer writer (19 steps, as it once was) gave training no more
    speed during a delta (W7: 0.62 against 0.63) and, on a busy machine, starved behind its
    own ps's loop, so deltas came late (0.2-0.4 s against 0.02-0.04 s at the loop's priority,
    both cores loaded) and a SIGKILL lost more than the delta interval promised."""
    saver = _SAVERS.get(kind)
    if saver is None:
        saver = _SAVERS[kind] = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"pstrain-save-{kind}"
        )
    return saver


async def remake_initial(records: list[VariableRecord]) -> None:
    """Make the initial values of ``records`` again, off the serving loop (a restore that
    released them failed or was aborted): a large initializer takes seconds."""
    for record in records:
        if record.initial is not None and not record.loaded:
            array = await asyncio.to_thread(record.initial)
            record.reload(array)
