"""A dataset function from a module the workers lack is sent by value, to worker processes
that cannot import it."""

from __future__ import annotations

import functools
import importlib
import uuid

import pytest

import pstrain
from pstrain.errors import ClosureInputError

pytestmark = pytest.mark.timeout(60)


HELPERS = """
import numpy as np
import pstrain

def make():
    return pstrain.data.Dataset.from_tensor_slices(np.arange(8.0)).repeat().batch(4)
"""


@pytest.mark.timeout(120)
async def test_a_dataset_fn_from_a_module_the_workers_lack_is_sent_by_value(tmp_path, monkeypatch):
    """The dataset_fn's helper module is on the coordinator's path only (a script's sibling
    module): it travels by value, as a scheduled function's does. One that cannot (hidden in
    a partial) fails with the import error and what to do, not 'resource does not exist'."""

    name, hidden_name = (f"{kind}_{uuid.uuid4().hex[:8]}" for kind in ("helpers", "hidden"))
    for module in (name, hidden_name):
        (tmp_path / f"{module}.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    helpers, hidden_module = (importlib.import_module(m) for m in (name, hidden_name))
    async with pstrain.LocalCluster(num_ps=1, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        try:
            it = iter(coordinator.create_per_worker_dataset(lambda: helpers.make()))
            assert await coordinator.schedule(lambda it: float(next(it).sum()), args=(it,)) == 6.0
            hidden = iter(coordinator.create_per_worker_dataset(functools.partial(hidden_module.make)))
            result = coordinator.schedule(lambda it: float(next(it).sum()), args=(hidden,))
            with pytest.raises(ClosureInputError) as info:
                await result
            message = str(info.value)
            assert f"No module named '{hidden_name}'" in message and "importable on every task" in message
            assert "does not exist" not in message
            with pytest.raises(ClosureInputError):
                await coordinator.join()
        finally:
            await coordinator.close()
