"""A worker's departure on SIGTERM: when it may go (``server/worker/departure.py``).

The drills with real processes are in ``test_faults.py``; these pin the rule itself.
"""

from __future__ import annotations

import asyncio

import pytest

from pstrain.errors import DrainingError
from pstrain.server.worker.departure import Departure

pytestmark = pytest.mark.timeout(30)


def clock() -> float:
    """The running loop's clock: the one the departure's timeout and linger are on (uvloop's
    ticks in milliseconds, read once per pass of the loop: ``time.monotonic()`` can find a
    0.5 s wait on it 0.4995 s long)."""
    return asyncio.get_running_loop().time()


def waited(started: float) -> float:
    """Seconds on :func:`clock` since ``started``, to the millisecond it ticks in (its
    values are milliseconds over 1000: a difference of 300 ticks can come out 0.29999...)."""
    return round(clock() - started, 6)


def test_a_refusal_or_a_flagged_reply_is_what_tells_the_coordinator():
    d = Departure()
    d.refuse("/job:worker/replica:0/task:1")  # not draining: nothing refused
    assert d.flag() is False and not d.told
    assert d.begin() and not d.begin()  # once
    assert d.draining and not d.told  # draining, but nobody has heard it yet
    with pytest.raises(DrainingError, match="task:1 is leaving"):
        d.refuse("/job:worker/replica:0/task:1")
    assert d.told
    d = Departure()
    d.begin()
    assert d.flag() is True and d.told


async def test_a_worker_told_nobody_waits_for_the_next_request_then_goes():
    d = Departure()
    d.begin()
    loop = asyncio.get_running_loop()

    def the_next_batch_is_refused():
        with pytest.raises(DrainingError):
            d.refuse("worker 1")

    started = clock()
    loop.call_later(0.2, the_next_batch_is_refused)
    assert await d.wait(lambda: False, lambda: True, timeout=60, linger_s=30)
    assert 0.2 <= waited(started) < 20  # went once told, not at the linger's end


async def test_without_word_it_goes_at_the_linger_s_end_and_at_once_with_no_client():
    d = Departure()
    d.begin()
    started = clock()
    assert await d.wait(lambda: False, lambda: True, timeout=60, linger_s=0.3)
    assert waited(started) >= 0.3
    started = clock()
    assert await d.wait(lambda: False, lambda: False, timeout=60, linger_s=30)
    assert waited(started) < 20  # nobody connected: nobody to tell


async def test_closures_running_past_the_timeout_say_so_and_the_linger_keeps_within_it():
    d = Departure()
    d.begin()
    started = clock()
    assert await d.wait(lambda: True, lambda: True, timeout=0.3) is False
    assert waited(started) >= 0.3
    running = [True]
    asyncio.get_running_loop().call_later(0.2, running.clear)
    started = clock()  # done within the timeout: True, the linger cut at the timeout
    assert await d.wait(lambda: bool(running), lambda: True, timeout=0.5, linger_s=30) is True
    assert 0.5 <= waited(started) < 20
