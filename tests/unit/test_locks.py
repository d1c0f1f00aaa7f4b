"""PlacementLock: saves share it, a move or restore holds it alone, first come first served,
and a waiter cancelled at any moment leaves it as if it had never asked."""

from __future__ import annotations

import asyncio

import pytest

from pstrain._base.locks import PlacementLock
from tests.helpers import wait_for

pytestmark = pytest.mark.timeout(30)


def _waiting(lock: PlacementLock) -> int:
    return len(lock._waiting)


async def test_saves_share_it_and_a_move_waits_for_them_then_saves_asked_later_wait_for_the_move():
    lock = PlacementLock()
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("save1", "save2", "move", "save3")}

    async def save(name: str) -> None:
        async with lock.shared():
            order.append(f"{name} in")
            await release[name].wait()
        order.append(f"{name} out")

    async def move() -> None:
        async with lock:
            order.append("move in")
            await release["move"].wait()
        order.append("move out")

    tasks = [asyncio.create_task(save("save1")), asyncio.create_task(save("save2"))]
    await wait_for(lambda: order == ["save1 in", "save2 in"], what="both saves in")
    tasks.append(asyncio.create_task(move()))
    await wait_for(lambda: _waiting(lock) == 1, what="the move to wait")
    tasks.append(asyncio.create_task(save("save3")))  # asked after the move: waits for it
    await wait_for(lambda: _waiting(lock) == 2, what="the third save to wait")
    release["save1"].set()
    await wait_for(lambda: "save1 out" in order, what="save1 out")
    assert _waiting(lock) == 2 and "move in" not in order  # the move still waits for save2
    release["save2"].set()
    await wait_for(lambda: "move in" in order, what="the move in")
    assert order[-2:] == ["save2 out", "move in"] and _waiting(lock) == 1  # save3 waits
    release["move"].set()
    await wait_for(lambda: "save3 in" in order, what="save3 in")
    assert order[-2:] == ["move out", "save3 in"]
    release["save3"].set()
    await asyncio.gather(*tasks)
    assert not lock.locked() and _waiting(lock) == 0


@pytest.mark.parametrize("cancel_at", ["waiting", "granted"])
async def test_a_cancelled_waiter_leaves_no_trace(cancel_at):
    lock = PlacementLock()
    save = lock.shared()
    await save.__aenter__()  # held by this test, released without yielding to the loop

    async def move() -> None:
        async with lock:
            raise AssertionError("a cancelled move never runs")

    mover = asyncio.create_task(move())
    await wait_for(lambda: _waiting(lock) == 1, what="the move to wait")
    if cancel_at == "granted":
        await save.__aexit__(None, None, None)  # granted to the move, which has not run yet
        assert lock.locked()
    mover.cancel()
    with pytest.raises(asyncio.CancelledError):
        await mover
    if cancel_at == "waiting":
        assert lock.locked()  # the save still holds it
        await save.__aexit__(None, None, None)
    assert not lock.locked() and _waiting(lock) == 0
    async with lock:  # free for anyone
        assert lock.locked()
    async with lock.shared():
        assert lock.locked()
    assert not lock.locked()
