"""What a Ctrl-C leaves behind. A checkpoint manager that writes deltas writes a last one
once the steps in flight have finished (a keep hook), so every finished step is kept; the
line ``pstrain.run`` ends with then names each manager's checkpoint kept (a report hook of
:mod:`pstrain._transport.interrupt`)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Protocol

from .._transport.interrupt import KEEP_HOOKS, REPORT_HOOKS

__all__ = ["track"]


class CheckpointManager(Protocol):  # what this module uses of one (no import: no cycle)
    @property
    def latest_checkpoint(self) -> str | None: ...

    @property
    def writing_deltas(self) -> bool: ...

    async def keep(self) -> str: ...


_managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
#: The last delta each manager wrote on interruption.
_kept_at: weakref.WeakKeyDictionary[CheckpointManager, str] = weakref.WeakKeyDictionary()


def track(manager: CheckpointManager) -> None:
    _managers.add(manager)


async def _keep() -> str | None:
    """Each manager writing deltas on this loop writes a last one of the finished steps."""
    managers = [m for m in list(_managers) if m.writing_deltas]
    paths = await asyncio.gather(*(m.keep() for m in managers))
    for manager, path in zip(managers, paths):
        _kept_at[manager] = path
    return None  # said by the report, with the managers that write no deltas


def _kept() -> str | None:
    managers = list(_managers)
    if not managers:
        return None
    said = []
    for manager in managers:
        last = _kept_at.pop(manager, None)
        if last is not None:
            said.append(f"{last} (a last delta, of every step finished)")
        elif (path := manager.latest_checkpoint) is not None:
            said.append(path)
    return "latest checkpoint " + ", ".join(said) if said else "no checkpoint was saved"


KEEP_HOOKS.append(_keep)
REPORT_HOOKS.append(_kept)
