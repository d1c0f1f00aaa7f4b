"""What a Ctrl-C leaves behind: each checkpoint manager's latest checkpoint (a report hook
of :mod:`pstrain._transport.interrupt`, printed in the line ``pstrain.run`` ends with)."""

from __future__ import annotations

import weakref
from typing import Protocol

from .._transport.interrupt import REPORT_HOOKS

__all__ = ["track"]


class CheckpointManager(Protocol):  # what this module reads of one (no import: no cycle)
    @property
    def latest_checkpoint(self) -> str | None: ...


_managers: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


def track(manager: CheckpointManager) -> None:
    _managers.add(manager)


def _kept() -> str | None:
    managers = list(_managers)
    if not managers:
        return None
    kept = [path for path in (m.latest_checkpoint for m in managers) if path]
    return "latest checkpoint " + ", ".join(kept) if kept else "no checkpoint was saved"


REPORT_HOOKS.append(_kept)
