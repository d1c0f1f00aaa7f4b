"""Worker membership as a state machine: sans-I/O slots, driven by the dispatchers.

A :class:`WorkerSlot` is one worker index of the job. Its lifecycle is an
enum of states with the transitions allowed between them; each event is a
method that checks the transition, changes the state and returns what the
caller (a :class:`~pstrain._coordinator.dispatch.WorkerDispatcher`, which does the I/O)
must do. Nothing here sends, sleeps or spawns, so every combination of events
is reached by a plain test (``tests/unit/test_membership.py``), and
:meth:`Membership.check` states the invariants a test checks at teardown, as
dask/distributed checks its worker state machine::

    joining ──connected──► up ──draining──► draining ──lost──► lost
       │                    │                                 ▲  │
       │                    └──────────────lost───────────────┘  │
       ├──lost──► lost ──connected──► up                          │
       └──replaced──► replaced ◄──────replaced────────────────────┘
    (any state but refused) ──refused──► refused (a configuration error: final)

* ``joining``: the slot exists, its worker was never reached.
* ``up``: connected; ``incarnation`` names the process.
* ``draining``: the worker is leaving (SIGTERM): no new work; its departure is no failure.
* ``lost``: unreachable; its closures went back to the queue. Losing an ``up``
  worker with closures in flight starts a new *epoch*: the caller fences the old
  one off every ps (``ps/fence``), so a worker only cut off cannot apply late updates.
* ``replaced``: a worker joined at a new address (``pstrain serve --join``); the
  next connection is to it.
* ``refused``: the task at the address is not this worker, or refuses the token.

>>> m = Membership(["127.0.0.1:2223"])
>>> slot = m.slot(0)
>>> slot.connected("a1")
True
>>> slot.lost("UnavailableError: gone", in_flight=2)   # fence epoch 2 on every ps
2
>>> slot.connected("b7"), slot.state.value, slot.failures
(True, 'up', 1)
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IllegalTransition", "Membership", "SlotState", "WorkerSlot"]


class SlotState(enum.Enum):
    JOINING = "joining"
    UP = "up"
    DRAINING = "draining"
    LOST = "lost"
    REPLACED = "replaced"
    REFUSED = "refused"


S = SlotState
#: state -> event -> the states it may lead to from there.
_ALLOWED: dict[SlotState, dict[str, SlotState]] = {
    S.JOINING: {"connected": S.UP, "lost": S.LOST, "replaced": S.REPLACED, "refused": S.REFUSED},
    S.UP: {"lost": S.LOST, "draining": S.DRAINING, "refused": S.REFUSED},
    S.DRAINING: {"lost": S.LOST, "refused": S.REFUSED},
    S.LOST: {"connected": S.UP, "lost": S.LOST, "replaced": S.REPLACED, "refused": S.REFUSED},
    S.REPLACED: {"connected": S.UP, "lost": S.LOST, "replaced": S.REPLACED, "refused": S.REFUSED},
    S.REFUSED: {},
}


class IllegalTransition(RuntimeError):
    """An event the slot's state does not allow: a bug in the caller, never the user's."""


@dataclass
class WorkerSlot:
    """Worker ``index`` of the job: its address, state, epoch, incarnation and counts."""

    index: int
    address: str
    state: SlotState = SlotState.JOINING
    #: Updates of this worker's dispatches carry the epoch; a loss with work in flight
    #: starts the next one, and the old one is fenced off every ps.
    epoch: int = 1
    incarnation: str | None = None
    failures: int = 0  # times it was found unreachable while up
    gave_up: int = 0  # dispatches given up while it was up (closures past the cancel grace)
    completed: int = 0  # closures it finished (any outcome)
    last_error: str | None = None  # why it was last lost or refused
    history: list[str] = field(default_factory=list, repr=False)  # events, for debugging

    def _go(self, event: str) -> SlotState:
        new = _ALLOWED[self.state].get(event)
        if new is None:
            raise IllegalTransition(
                f"worker slot {self.index}: {event!r} is not allowed in "
                f"state {self.state.value!r} (after {self.history[-5:]})"
            )
        self.history.append(event)
        if len(self.history) > 64:
            del self.history[:32]
        self.state = new
        return new

    # -- the state as the rest of the program asks it -----------------------------------------
    @property
    def up(self) -> bool:
        """Connected: it runs closures (a draining worker finishes those it has)."""
        return self.state in (S.UP, S.DRAINING)

    @property
    def leaving(self) -> bool:
        return self.state is S.DRAINING

    @property
    def takes_work(self) -> bool:
        return self.state is S.UP

    # -- events -----------------------------------------------------------------------------
    def connected(self, incarnation: str) -> bool:
        """It answered ``worker/configure`` as ``incarnation``. Returns True when that is a
        new process (its per-worker resources must be built, functions sent again)."""
        self._go("connected")
        fresh = incarnation != self.incarnation
        self.incarnation = incarnation
        return fresh

    def draining(self) -> None:
        """It said it is leaving: no new work; its departure will not count as a failure."""
        self._go("draining")

    def said_leaving(self) -> None:
        """It said again that it is leaving (with results, or by refusing work): draining if
        it was up; once draining, or already lost, the word changes nothing."""
        if self.state is S.UP:
            self.draining()

    def lost(self, reason: str, in_flight: int = 0) -> int | None:
        """It could not be reached (or left, drained). Returns the epoch to fence off every
        ps before its ``in_flight`` closures run elsewhere, or None when nothing needs it."""
        was = self.state
        self._go("lost")
        self.last_error = reason
        if was is S.UP:
            self.failures += 1
        if was is S.UP and in_flight > 0:
            self.epoch += 1
            return self.epoch
        return None

    def give_up(self, in_flight: int) -> int | None:
        """Its ``in_flight`` closures still ran ``cancel_grace_s`` after the job's error
        (their RemoteValues raised CancelledError). Not a transition: a new epoch, the old
        one to fence off every ps, so that their late updates are refused (after a
        restore too). None when nothing needs it."""
        if not self.up or in_flight <= 0:
            return None
        self.gave_up += 1
        self.epoch += 1
        return self.epoch

    def replaced(self, address: str) -> None:
        """A worker joined at ``address`` and takes this slot."""
        self._go("replaced")
        self.address = address

    def refused(self, reason: str) -> None:
        """A configuration error (wrong token, another task at the address): final."""
        self._go("refused")
        self.last_error = reason

    def check(self) -> None:
        """The invariants of one slot (AssertionError naming the broken one)."""
        assert self.index >= 0, self
        assert self.epoch >= 1 and self.failures >= 0 and self.completed >= 0, self
        assert self.epoch <= self.failures + self.gave_up + 1, (
            f"an epoch starts only with a loss (or closures given up): {self}"
        )
        if self.state in (S.UP, S.DRAINING):
            assert self.incarnation is not None, f"connected without an incarnation: {self}"
        if self.state is S.JOINING:
            assert self.failures == 0 and self.epoch == 1, f"joining after a loss: {self}"
        if self.state is S.REFUSED:
            assert self.last_error, f"refused without a reason: {self}"

    def as_dict(self) -> dict[str, Any]:
        """What ``/v1/membership``, the dashboard and ``pstrain status`` show."""
        return {
            "index": self.index,
            "task": f"/job:worker/replica:0/task:{self.index}",
            "address": self.address,
            "state": self.state.value,
            "up": self.up,
            "leaving": self.leaving,
            "failures": self.failures,
            "epoch": self.epoch,
            "incarnation": self.incarnation,
            "completed": self.completed,
            "last_error": self.last_error,
        }


class Membership:
    """The worker slots of one coordinator, by index; who may take a joining worker."""

    def __init__(self, addresses: list[str]) -> None:
        self._slots = [WorkerSlot(i, a) for i, a in enumerate(addresses)]

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[WorkerSlot]:
        return iter(self._slots)

    def slot(self, index: int) -> WorkerSlot:
        return self._slots[index]

    def up(self) -> list[int]:
        """Indices of the workers connected now."""
        return [s.index for s in self._slots if s.up]

    def admit(self, address: str) -> tuple[WorkerSlot, bool]:
        """A worker at ``address`` asks to join: the slot it takes, and whether the job grows.

        The slot already at that address (the same worker asking again), else the first
        slot whose worker is gone (found unreachable: a slot not tried yet is its worker's,
        which may be starting, as after a coordinator restarts), else a new slot at the end.
        A slot taken over is ``replaced`` (its address changes) and stays reserved for that
        worker until it connects or is found unreachable."""
        slot = self.slot_for(address)
        if slot is None:
            slot = WorkerSlot(len(self._slots), address)
            slot.replaced(address)  # reserved for the worker that asked, as a slot taken over
            self._slots.append(slot)
            return slot, True
        if not slot.up:
            slot.replaced(address)
        return slot, False

    def slot_for(self, address: str) -> WorkerSlot | None:
        """The slot ``admit(address)`` would give, changing nothing (None: a new one)."""
        known = next((s for s in self._slots if s.address == address and s.state is not S.REFUSED), None)
        return known or next((s for s in self._slots if s.state is S.LOST), None)

    def addresses(self) -> list[str]:
        return [s.address for s in self._slots]

    def check(self) -> None:
        """Every slot's invariants, and indices 0..n-1 in order."""
        for i, s in enumerate(self._slots):
            assert s.index == i, f"slot {i} says it is {s.index}"
            s.check()

    def snapshot(self) -> list[dict[str, Any]]:
        return [s.as_dict() for s in self._slots]
