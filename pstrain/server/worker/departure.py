"""A worker's departure on SIGTERM (a spot machine's preemption notice).

It takes no new closures (each is refused with ``DrainingError`` and runs on another
worker), lets those running finish and report, and goes once the coordinator has heard
that it is leaving: a reply flagged ``leaving`` or a refusal tells it, and then its going
is no failure. A worker with nothing running when the signal came has told nobody yet:
it stays (refusing work) until the coordinator's next request hears it, for at most
:data:`LINGER_S`, or until no client is connected. Gone at once, the batch already on its
way would meet a closed port and count as a lost worker, its closures as retries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..._base.errors import DrainingError

__all__ = ["LINGER_S", "Departure"]

#: How long a drained worker waits for the coordinator to hear it is leaving (a busy
#: coordinator sends within milliseconds; an idle one learns it at its next request).
LINGER_S = 2.0

_POLL_S = 0.02  # a leaving process polls its own state; no peer waits on it


class Departure:
    """Whether the worker is leaving, and whether a reply has said so since."""

    def __init__(self) -> None:
        self.draining = False
        self.told = False  # a reply or a refusal has said "leaving" since draining began

    def begin(self) -> bool:
        """Start draining; False if it had already begun."""
        begun, self.draining = not self.draining, True
        return begun

    def refuse(self, task: str) -> None:
        """Refuse new work while draining; the refusal itself tells the coordinator."""
        if self.draining:
            self.told = True
            raise DrainingError(f"{task} is leaving (draining): its closures go to other workers", task=task)

    def flag(self) -> bool:
        """The ``leaving`` flag of a reply about to be sent."""
        self.told |= self.draining
        return self.draining

    async def wait(
        self,
        busy: Callable[[], bool],
        connected: Callable[[], bool],
        timeout: float,
        linger_s: float = LINGER_S,
    ) -> bool:
        """Wait until nothing is ``busy`` (closures running, results unsent): False if that
        takes over ``timeout`` s. Then wait up to ``linger_s`` more (within ``timeout``)
        until the coordinator has been told, or no client is ``connected``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        linger: float | None = None
        while True:
            now = loop.time()
            if not busy():
                if self.told or not connected():
                    return True
                if linger is None:
                    linger = min(now + linger_s, deadline)
                if now >= linger:
                    return True  # its closures are done; the coordinator learns at its next try
            elif now >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
