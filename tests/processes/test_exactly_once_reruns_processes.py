"""Exactly-once reruns on real processes: an attempt that died between its updates."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import pstrain
from pstrain._variables.batched import read_variables

pytestmark = pytest.mark.timeout(120)


def _step(a, b, marker: str):
    """Reads both variables, then changes ``a`` (one operation), then ``b`` (another) from
    the values read. Its first attempt kills its own worker between the two."""

    async def step():
        va, vb = await read_variables([a, b])
        await a.assign_add(va * vb)
        if not os.path.exists(marker):
            with open(marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)  # the first attempt dies here: `a` changed
        await b.assign_add(va + vb)
        return float(vb[0])

    return step


async def test_a_rerun_after_an_attempt_died_between_its_updates_computes_what_it_would_have(
    process_cluster, tmp_path
):
    strategy = pstrain.ParameterServerStrategy(process_cluster.resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    async with strategy.scope():
        a = pstrain.Variable(np.array([1.0, 3.0]), name="a")
        b = pstrain.Variable(np.array([2.0, 5.0]), name="b")
    assert a.ps_index != b.ps_index  # one ps took the first update, the other never got one
    marker = str(tmp_path / "first-attempt")
    rv = coordinator.schedule(_step(a, b, marker), exactly_once=True)
    await coordinator.join()
    assert os.path.exists(marker) and coordinator.closures_retried >= 1
    assert await rv.get() == 2.0  # the rerun read b as the first attempt did
    # the run without the fault: a = a + a*b, b = b + a + b, from the values before it
    np.testing.assert_array_equal(await a.numpy(), [3.0, 18.0])
    np.testing.assert_array_equal(await b.numpy(), [5.0, 13.0])  # not [7, 28]: a's new values
    await coordinator.close()
