"""Ctrl-C under ``pstrain.run``: finish the steps in flight, say what was kept, exit 130.

A terminal's Ctrl-C (SIGINT to the foreground process group) used to cancel the
program mid-step: closures in flight were abandoned, and the traceback of the cancellation
was all a user saw. Under :func:`pstrain.run` the first SIGINT instead

1. runs the *drain hooks* (a coordinator cancels its queued closures, refuses new ones and
   waits for those in flight, together at most :data:`GRACE_S` seconds),
2. runs the *keep hooks* (a checkpoint manager writing deltas writes a last one, of every
   step finished: at most :data:`KEEP_S` seconds), while the program still waits on its
   steps (it must not unwind, stopping its cluster, before they are kept),
3. runs the *stop hooks* (a coordinator cancels its queued closures), then cancels the
   program's main coroutine,
4. prints one line to stderr with what each hook and *report hook* said (steps finished,
   steps cancelled, the checkpoint kept), and ``pstrain.run`` raises ``SystemExit(130)``,
   the exit status of a program ended by SIGINT.

A second SIGINT cancels the program at once. Hooks are registered by the layers above (the
coordinator, the checkpoint manager) so this module knows none of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable

__all__ = ["DRAIN_HOOKS", "GRACE_S", "KEEP_HOOKS", "KEEP_S", "REPORT_HOOKS", "STOP_HOOKS", "Interruption"]

logger = logging.getLogger(__name__)

#: How long the steps in flight get to finish after Ctrl-C.
GRACE_S = 4.0
#: ``async hook(grace_s) -> summary or None``: stop taking work, let what runs finish.
DRAIN_HOOKS: list[Callable[[float], Awaitable[str | None]]] = []
#: How long the keep hooks get, together, once the steps have stopped.
KEEP_S = 60.0
#: ``async hook() -> summary or None``: keep what the finished steps did (after the drains).
KEEP_HOOKS: list[Callable[[], Awaitable[str | None]]] = []
#: ``hook()``: drop the work not run (after the keep hooks, before the program is cancelled).
STOP_HOOKS: list[Callable[[], None]] = []
#: ``hook() -> summary or None``: what was kept (run after the drain and keep hooks).
REPORT_HOOKS: list[Callable[[], str | None]] = []


class Interruption:
    """The SIGINT handling of one ``pstrain.run``; see the module docstring."""

    def __init__(self) -> None:
        self.fired = False
        self.summaries: list[str] = []
        self._task: asyncio.Task[object] | None = None
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended = False

    def install(self) -> None:
        """Handle SIGINT on the running loop for the current task (the main thread only:
        elsewhere there is no signal to handle)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        try:
            self._loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):  # no signals on this loop
            self._loop = None

    async def uninstall(self) -> None:
        """The program ended: if Ctrl-C came, first let its drain finish (it is bounded, and
        the program may have ended because the drain cancelled what it awaited)."""
        self._ended = True
        if self._drain is not None and not self._drain.done():
            with contextlib.suppress(asyncio.CancelledError):  # a second Ctrl-C: go now
                await self._drain
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGINT)
            self._loop = None
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()

    def _on_sigint(self) -> None:
        if self._task is None:
            return
        if self.fired:  # a second Ctrl-C: now
            self._task.cancel()
            return
        self.fired = True
        assert self._loop is not None
        self._drain = self._loop.create_task(self._finish_steps())

    async def _finish_steps(self) -> None:
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(hook(GRACE_S) for hook in DRAIN_HOOKS), return_exceptions=True),
                GRACE_S + 1.0,
            )
            self.summaries += [r for r in results if isinstance(r, str) and r]
        except TimeoutError:
            self.summaries.append(f"steps still running after {GRACE_S:g} s were abandoned")
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(hook() for hook in KEEP_HOOKS), return_exceptions=True), KEEP_S
            )
            for r in results:
                if isinstance(r, BaseException):
                    logger.error("keeping the finished steps on interruption failed: %s", r)
                    self.summaries.append(f"the last checkpoint failed ({r})")
                elif r:
                    self.summaries.append(r)
        except TimeoutError:
            self.summaries.append(f"the last checkpoint took over {KEEP_S:g} s and was abandoned")
        for stop in STOP_HOOKS:
            try:
                stop()
            except Exception:  # must not keep the program from stopping
                logger.exception("stopping on interruption failed")
        for report in REPORT_HOOKS:
            try:
                line = report()
            except Exception:  # a report must not keep the program from stopping
                logger.exception("a report on interruption failed")
                continue
            if line:
                self.summaries.append(line)
        assert self._task is not None
        if not self._ended:  # else it is ending already, and waits for this
            self._task.cancel()

    def line(self) -> str:
        """The one line printed when the program ends interrupted."""
        said = "; ".join(self.summaries) or "nothing was running"
        return f"pstrain: interrupted (Ctrl-C): {said}"
