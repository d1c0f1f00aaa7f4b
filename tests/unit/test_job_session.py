"""The job's state lives in a JobSession that a channel pool carries and every channel it
opens reads: an owner set, a fence recorded or a map adopted once is what every channel of
the pool sends and sees, whenever the channel was opened."""

from __future__ import annotations

import pytest

from pstrain.cluster import ClusterSpec
from pstrain.rpc import Channel, ChannelPool

pytestmark = pytest.mark.timeout(30)


async def test_a_pools_channels_share_its_job_session():
    pool = ChannelPool(
        ClusterSpec({"ps": ["127.0.0.1:1", "127.0.0.1:3"], "worker": ["127.0.0.1:2"]}), token="t"
    )
    early = pool.channel("ps", 0)  # opened before the owner is known (no connection yet)
    pool.session.owner = "a" * 32
    pool.session.fences[3] = 7
    late = pool.channel("worker", 0)
    try:
        assert early.session is late.session is pool.session
        assert early.owner == late.owner == "a" * 32 and early.session.fences == {3: 7}
        assert pool.session.routes.ps == ["127.0.0.1:1", "127.0.0.1:3"]
        late.owner = "b" * 32  # the name 0.1 had sets the session's
        assert pool.session.owner == early.owner == "b" * 32
        alone = Channel("127.0.0.1:1", token="t", task="/job:ps/replica:0/task:0")
        assert alone.session is not pool.session and alone.owner is None and alone.session.routes.ps == []
    finally:
        await pool.close()
