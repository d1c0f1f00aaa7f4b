"""The in-process cluster's leak check, seen from a pytest run of its own."""

from __future__ import annotations

import asyncio

import pytest

from pstrain.testing import InProcessCluster, LeakError

pytestmark = pytest.mark.timeout(20)


# -- the in-process cluster -----------------------------------------------------------------------------
async def test_the_in_process_cluster_fails_a_test_that_leaks_a_task():
    cluster = await InProcessCluster(num_ps=1, num_workers=1, leak_grace_s=0.2).start()
    leaked = asyncio.ensure_future(asyncio.sleep(30))
    try:
        with pytest.raises(LeakError, match="task"):
            await cluster.close()
    finally:
        leaked.cancel()
        await asyncio.gather(leaked, return_exceptions=True)
