"""Scalars for TensorBoard and the dashboard: ``pstrain.summary.scalar(name, value, step)``.

As ``tf.summary``: make a writer with :func:`create_file_writer` on the
coordinator and make it the default (``with writer.as_default():`` or
``writer.set_as_default()``); then ``scalar(name, value, step)`` from the
coordinator *or from closures* is written to its TensorBoard event files
(``tensorboardX``'s writer, read by TensorBoard itself). A closure's scalars
travel back with its result, so a scalar logged by a closure that is retried
after its worker died may be logged twice; the dashboard shows them all.

Every scalar also lands in the coordinator's :data:`LOG` (the last
``MAX_POINTS`` per name), which the dashboard draws. Without a default writer
scalars only go there.

>>> LOG.clear()
>>> scalar("loss", 0.5, step=1)
>>> LOG.points("loss")
[(1, 0.5)]
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from .._base.context import scalar_sink
from .._base.errors import InvalidArgumentError
from .._base.exports import expose

__all__ = ["LOG", "ScalarLog", "SummaryWriter", "create_file_writer", "flush", "scalar"]

MAX_POINTS = 100_000  # per name, on the coordinator


class ScalarLog:
    """The scalars seen by this process (the coordinator): per name, ``(step, value)`` in
    arrival order, the newest ``MAX_POINTS``; a sequence number per point lets the dashboard
    ask for what is new."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._points: dict[str, deque[tuple[int, int, float, float]]] = {}
        self._seq = 0

    def add(self, name: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Record ``value`` of scalar ``name`` at ``step``."""
        with self._lock:
            self._seq += 1
            points = self._points.get(name)
            if points is None:
                points = self._points[name] = deque(maxlen=MAX_POINTS)
            points.append((self._seq, step, value, wall_time or time.time()))

    def points(self, name: str) -> list[tuple[int, float]]:
        """``(step, value)`` of scalar ``name``, in the order recorded."""
        with self._lock:
            return [(step, value) for _, step, value, _ in self._points.get(name, ())]

    def names(self) -> list[str]:
        """The names of the scalars recorded."""
        with self._lock:
            return sorted(self._points)

    def since(self, seq: int) -> tuple[int, dict[str, list[tuple[int, float]]]]:
        """Points added after sequence number ``seq``, by name, and the newest number."""
        with self._lock:
            out: dict[str, list[tuple[int, float]]] = {}
            for name, pts in self._points.items():
                new = []
                for q, step, value, _ in reversed(pts):  # newest first: stop at the old ones
                    if q <= seq:
                        break
                    new.append((step, value))
                if new:
                    out[name] = new[::-1]
            return self._seq, out

    def clear(self) -> None:
        """Forget every point."""
        with self._lock:
            self._points.clear()


#: This process's scalars (on the coordinator: its own and its closures').
LOG = ScalarLog()


class SummaryWriter:
    """TensorBoard event files under ``logdir`` (made by :func:`create_file_writer`)."""

    def __init__(self, logdir: str, flush_secs: float = 2.0) -> None:
        try:
            from tensorboardX import SummaryWriter as _Writer
        except ImportError as exc:  # pragma: no cover - a core dependency
            raise InvalidArgumentError(
                "pstrain.summary needs tensorboardX: pip install tensorboardX"
            ) from exc
        self.logdir = logdir
        self._writer = _Writer(logdir=logdir, flush_secs=flush_secs)
        self._lock = threading.Lock()

    def scalar(self, name: str, value: float, step: int, wall_time: float | None = None) -> None:
        """Write ``value`` of scalar ``name`` at ``step`` (TensorBoard's event file)."""
        with self._lock:
            self._writer.add_scalar(name, value, global_step=step, walltime=wall_time)

    def flush(self) -> None:
        """Write what is buffered to the event file."""
        with self._lock:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        global _default
        with self._lock:
            self._writer.close()
        if _default is self:
            _default = None

    def set_as_default(self) -> None:
        """Make this writer the one ``pstrain.summary.scalar`` writes to (until it is closed)."""
        global _default
        _default = self

    @contextlib.contextmanager
    def as_default(self) -> Iterator[SummaryWriter]:
        """``with writer.as_default():`` scalars go to this writer (and it is flushed after)."""
        global _default
        previous, _default = _default, self
        try:
            yield self
        finally:
            _default = previous
            self.flush()


_default: SummaryWriter | None = None


def create_file_writer(logdir: str, flush_millis: int = 2000) -> SummaryWriter:
    """A writer of TensorBoard event files in ``logdir`` (TF's ``create_file_writer``)."""
    return SummaryWriter(str(logdir), flush_secs=flush_millis / 1000)


def _checked(name: Any, data: Any, step: Any) -> tuple[str, float, int]:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a summary's name must be a non-empty string, got {name!r}")
    try:
        value = float(data)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"summary {name!r}: the value must be a number, got {type(data).__name__}"
        ) from None
    if step is None:
        raise InvalidArgumentError(
            f"summary {name!r}: give a step (as tf.summary.scalar does when no default step is set)"
        )
    if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
        raise InvalidArgumentError(f"summary {name!r}: step must be an integer, got {step!r}")
    return name, value, int(step)


def scalar(name: str, data: Any, step: int | None = None, description: str | None = None) -> None:
    """Log ``data`` (a number) as scalar ``name`` at ``step``: from the coordinator it goes
    to the default writer (if any) and the dashboard; from a closure it travels back with
    the closure's result and then does the same on the coordinator. ``description`` is
    accepted for TF's signature and not stored."""
    name, value, step_ = _checked(name, data, step)
    sink = scalar_sink()
    if sink is not None:  # inside a closure: the worker sends it back
        sink(name, value, step_, time.time())
        return
    record(name, value, step_, time.time())


def record(name: str, value: float, step: int, wall_time: float) -> None:
    """A scalar arrived on the coordinator (its own, or a closure's)."""
    if not math.isfinite(value):
        value = float(value)  # NaN and inf are logged as they are, as TensorBoard shows them
    LOG.add(name, value, step, wall_time)
    writer = _default
    if writer is not None:
        writer.scalar(name, value, step, wall_time)


def record_from_worker(records: list[Any]) -> None:
    """Scalars a closure logged with ``pstrain.summary`` (they came back with its result)."""
    for rec in records:
        try:
            name, value, step, wall = rec
            record(str(name), float(value), int(step), float(wall))
        except (TypeError, ValueError):
            logging.getLogger("pstrain.summary").warning("a worker sent a malformed scalar: %r", rec)


def flush() -> None:
    """Flush the default writer's events to disk."""
    if _default is not None:
        _default.flush()


expose(globals(), "pstrain.summary")
