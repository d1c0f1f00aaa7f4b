"""What a coordinator knows of each parameter server: sans-I/O, driven by the heartbeat.

The coordinator pings every ps (``health``) and hands each outcome to
:class:`PsHealth`, which decides what it means: a ps that answers with a new
*incarnation* restarted and lost its variables (``UnavailableError`` telling
the user to restore), unless the program already restored a checkpoint onto
that very incarnation; a ps silent while closures run fails the job; a ps that
refuses the token is misconfigured. The restores the program made are recorded
by its job session (``JobSession.restored``), one per strategy, not in a
process global, so two coordinators in one process never see each other's.

>>> health = PsHealth(1, restored={})
>>> health.answered(0, "a1") is None           # first sight
True
>>> str(health.answered(0, "b2")).split(": ")[0]
'parameter server /job:ps/replica:0/task:0 restarted (incarnation a1 is now b2)'
>>> health.handled(health.answered(0, "c3"))  # no checkpoint restored onto c3
False
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..._base.cluster import task_name
from ..._base.errors import PsRestartedError, PstrainError, UnavailableError

__all__ = ["PsHealth"]


class PsHealth:
    """Each ps's last incarnation, whether it answers, and the restarts already handled."""

    def __init__(self, num_ps: int, restored: Mapping[str, Collection[str]]) -> None:
        self.incarnations: list[str | None] = [None] * num_ps
        #: ps index -> why it does not answer (a partition, a dead process, a wrong token)
        self.down: dict[int, str] = {}
        #: task -> incarnations a checkpoint was restored onto (kept by the channel pool)
        self._restored = restored
        #: A restart found while another error was pending: join reports it next.
        self.deferred: UnavailableError | None = None

    def grow(self, num_ps: int) -> None:
        """A ps joined: track ``num_ps`` in all."""
        self.incarnations += [None] * (num_ps - len(self.incarnations))

    def answered(self, k: int, incarnation: str | None) -> PsRestartedError | None:
        """Ps ``k`` answered as ``incarnation``: the error to report if it restarted."""
        self.down.pop(k, None)
        known = self.incarnations[k]
        self.incarnations[k] = incarnation
        task = task_name("ps", k)
        if known is None or incarnation == known or self._was_restored(task, incarnation):
            return None  # (restarted, but the program restored a checkpoint onto it already)
        return PsRestartedError(
            f"parameter server {task} restarted (incarnation {known[:8]} is now "
            f"{str(incarnation)[:8]}): the variables it held are lost; restore the latest "
            "checkpoint to continue",
            task=task,
            incarnation=incarnation,
        )

    def silent(self, k: int, reason: str, busy: bool) -> UnavailableError | None:
        """Ps ``k`` did not answer: while closures run (``busy``), that fails the job."""
        self.down[k] = reason
        if not busy:
            return None
        task = task_name("ps", k)
        return UnavailableError(
            f"parameter server {task} is unreachable ({reason}). If it answers again (a "
            "network partition), its state is intact: schedule the failed work again; if "
            "it restarted, the next error says so, and the latest checkpoint must be "
            "restored",
            task=task,
        )

    def misconfigured(self, k: int, error: PstrainError) -> None:
        """Ps ``k`` refused us (a wrong token, not a pstrain server)."""
        self.down[k] = f"{type(error).__name__}: {error}"

    def handled(self, error: BaseException | None) -> bool:
        """Is ``error`` a restart the program has since handled (it restored a checkpoint
        onto that very incarnation, having learnt of the loss another way)?"""
        return isinstance(error, PsRestartedError) and self._was_restored(
            str(error.task or ""), error.incarnation
        )

    def _was_restored(self, task: str, incarnation: str | None) -> bool:
        return incarnation is not None and incarnation in self._restored.get(task, ())
