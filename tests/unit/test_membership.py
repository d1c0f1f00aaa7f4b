"""The worker-slot state machine and the ps health record, without processes or sockets:
every transition, every illegal one refused, the invariants checked at teardown, and
random event sequences (hypothesis) that keep them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings, strategies as st

from pstrain._coordinator.elastic.health import PsHealth
from pstrain._coordinator.membership import IllegalTransition, Membership, SlotState, WorkerSlot
from pstrain.errors import AuthenticationError, UnavailableError

pytestmark = pytest.mark.timeout(60)

S = SlotState
EVENTS = ("connected", "draining", "lost", "replaced", "refused")
#: What the issue asks for, written out independently of the module's own table.
LEGAL = {
    (S.JOINING, "connected"): S.UP,
    (S.JOINING, "lost"): S.LOST,
    (S.JOINING, "replaced"): S.REPLACED,
    (S.JOINING, "refused"): S.REFUSED,
    (S.UP, "lost"): S.LOST,
    (S.UP, "draining"): S.DRAINING,
    (S.UP, "refused"): S.REFUSED,
    (S.DRAINING, "lost"): S.LOST,
    (S.DRAINING, "refused"): S.REFUSED,
    (S.LOST, "connected"): S.UP,
    (S.LOST, "lost"): S.LOST,
    (S.LOST, "replaced"): S.REPLACED,
    (S.LOST, "refused"): S.REFUSED,
    (S.REPLACED, "connected"): S.UP,
    (S.REPLACED, "lost"): S.LOST,
    (S.REPLACED, "replaced"): S.REPLACED,
    (S.REPLACED, "refused"): S.REFUSED,
}


@pytest.fixture
def membership() -> Iterator[Membership]:
    """A membership whose invariants are checked when the test ends, whatever it did."""
    m = Membership(["127.0.0.1:1", "127.0.0.1:2"])
    yield m
    m.check()


def _fire(slot: WorkerSlot, event: str, in_flight: int = 0) -> object:
    if event == "connected":
        return slot.connected(f"inc-{len(slot.history)}")
    if event == "lost":
        return slot.lost("UnavailableError: gone", in_flight)
    if event == "replaced":
        return slot.replaced("127.0.0.1:9")
    if event == "refused":
        return slot.refused("AuthenticationError: wrong token")
    return slot.draining()


_PATHS = {  # a way into each state from joining
    S.JOINING: [],
    S.UP: ["connected"],
    S.DRAINING: ["connected", "draining"],
    S.LOST: ["connected", "lost"],
    S.REPLACED: ["replaced"],
    S.REFUSED: ["refused"],
}


@pytest.mark.parametrize("state", list(SlotState), ids=lambda s: s.value)
@pytest.mark.parametrize("event", EVENTS)
def test_every_transition_is_allowed_or_refused_as_specified(state, event):
    slot = WorkerSlot(0, "127.0.0.1:1")
    for step in _PATHS[state]:
        _fire(slot, step)
    assert slot.state is state
    before = (slot.state, slot.epoch, slot.failures, slot.address, slot.incarnation)
    if (state, event) in LEGAL:
        _fire(slot, event)
        assert slot.state is LEGAL[(state, event)]
    else:
        with pytest.raises(IllegalTransition, match=f"{event!r} is not allowed in state"):
            _fire(slot, event)
        assert (slot.state, slot.epoch, slot.failures, slot.address, slot.incarnation) == before
    slot.check()


def test_a_loss_with_work_in_flight_starts_a_new_epoch_to_fence(membership):
    slot = membership.slot(0)
    assert slot.connected("a") is True  # a new process: build its resources
    assert slot.lost("UnavailableError: x", in_flight=0) is None  # nothing to fence
    assert slot.failures == 1 and slot.epoch == 1
    assert slot.connected("a") is False  # the same process came back: keep its resources
    assert slot.lost("UnavailableError: x", in_flight=3) == 2
    assert slot.connected("b") is True and slot.epoch == 2 and slot.failures == 2


def test_a_drained_worker_leaving_is_no_failure(membership):
    slot = membership.slot(1)
    slot.connected("a")
    slot.draining()
    assert slot.up and slot.leaving and not slot.takes_work
    assert slot.lost("DrainingError: left", in_flight=0) is None
    assert slot.failures == 0 and not slot.up


def test_saying_again_that_it_leaves_drains_an_up_worker_and_changes_nothing_else(membership):
    slot = membership.slot(0)
    slot.said_leaving()  # joining: nothing to drain
    assert slot.state is S.JOINING
    slot.connected("a")
    slot.said_leaving()
    slot.said_leaving()  # with the next results too
    assert slot.state is S.DRAINING and slot.history.count("draining") == 1
    slot.lost("DrainingError: left")
    slot.said_leaving()  # a late reply of the worker that left
    assert slot.state is S.LOST and slot.failures == 0


def test_a_lost_slot_never_reached_again_counts_once(membership):
    slot = membership.slot(0)
    slot.lost("UnavailableError: never reached")  # joining: not a failure
    slot.lost("UnavailableError: still not")
    assert slot.failures == 0 and slot.state is S.LOST


def test_admission_takes_the_known_slot_then_a_vacant_one_then_grows(membership):
    membership.slot(0).connected("a")
    membership.slot(1).connected("b")
    slot, grew = membership.admit("127.0.0.1:2")  # the worker at slot 1 asks again: no change
    assert (slot.index, grew, slot.state) == (1, False, S.UP)
    membership.slot(0).lost("UnavailableError: preempted", in_flight=1)
    slot, grew = membership.admit("127.0.0.1:7")  # a replacement takes the lost slot
    assert (slot.index, grew, slot.state, slot.address) == (0, False, S.REPLACED, "127.0.0.1:7")
    slot, grew = membership.admit("127.0.0.1:8")  # every slot taken: the job grows
    assert (slot.index, grew, slot.state) == (2, True, S.REPLACED)  # reserved for it
    assert membership.addresses() == ["127.0.0.1:7", "127.0.0.1:2", "127.0.0.1:8"]
    assert membership.up() == [1]
    membership.slot(0).refused("ProtocolError: not a worker")
    slot, grew = membership.admit("127.0.0.1:7")  # a refused slot is not taken again
    assert (slot.index, grew) == (3, True)


def test_a_joining_worker_does_not_take_a_slot_whose_worker_was_not_tried_yet(membership):
    # a coordinator just started again: its workers are starting or about to be reached
    slot, grew = membership.admit("127.0.0.1:7")
    assert (slot.index, grew) == (2, True)
    assert membership.addresses() == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:7"]
    membership.slot(1).lost("UnavailableError: never reached")
    slot, grew = membership.admit("127.0.0.1:8")  # found unreachable: its slot is taken
    assert (slot.index, grew, slot.address) == (1, False, "127.0.0.1:8")


def test_broken_invariants_are_caught():
    slot = WorkerSlot(0, "127.0.0.1:1", state=S.UP)  # up without an incarnation
    with pytest.raises(AssertionError, match="without an incarnation"):
        slot.check()
    slot = WorkerSlot(0, "127.0.0.1:1", epoch=3)  # an epoch no loss started
    with pytest.raises(AssertionError, match="epoch starts only with a loss"):
        slot.check()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(EVENTS), st.integers(0, 2)), max_size=60))
def test_any_sequence_of_events_keeps_the_invariants(events):
    m = Membership(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    for index, event, in_flight in events:
        slot = m.slot(index)
        expected = LEGAL.get((slot.state, event))
        failures, epoch, was = slot.failures, slot.epoch, slot.state
        if expected is None:
            with pytest.raises(IllegalTransition):
                _fire(slot, event, in_flight)
            continue
        fence = _fire(slot, event, in_flight)
        assert slot.state is expected
        if event == "lost":
            assert slot.failures == failures + (was is S.UP)
            assert fence == (epoch + 1 if was is S.UP and in_flight else None)
        m.check()


# -- ps health ----------------------------------------------------------------------------------
def test_ps_health_reports_a_restart_unless_a_restore_handled_it():
    restored: dict[str, set[str]] = {}
    health = PsHealth(2, restored)
    assert health.answered(0, "a") is None and health.answered(1, "x") is None
    error = health.answered(1, "y")
    assert isinstance(error, UnavailableError) and "restarted" in str(error)
    assert error.task == "/job:ps/replica:0/task:1" and not health.handled(error)
    restored["/job:ps/replica:0/task:1"] = {"y"}  # the program restored a checkpoint onto y
    assert health.handled(error)
    assert health.answered(1, "y") is None and health.incarnations == ["a", "y"]


def test_ps_health_fails_the_job_only_for_silence_while_busy():
    health = PsHealth(1, {})
    assert health.silent(0, "DeadlineExceededError: 10 s", busy=False) is None
    assert 0 in health.down
    error = health.silent(0, "UnavailableError: refused", busy=True)
    assert isinstance(error, UnavailableError) and "partition" in str(error)
    health.answered(0, "a")
    assert health.down == {}
    health.misconfigured(0, AuthenticationError("wrong token"))
    assert "AuthenticationError" in health.down[0]


def test_two_coordinators_in_one_process_keep_their_own_restores():
    mine: dict[str, set[str]] = {}
    theirs: dict[str, set[str]] = {"/job:ps/replica:0/task:0": {"b"}}
    health = PsHealth(1, mine)
    health.answered(0, "a")
    error = health.answered(0, "b")
    assert error is not None and not health.handled(error)  # another strategy's restore
    other = PsHealth(1, theirs)
    assert other.handled(error)
