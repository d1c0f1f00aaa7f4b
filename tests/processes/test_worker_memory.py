"""A worker keeps the memory its steps free for its next steps (``pstrain serve
--keep-freed``): a step's arrays are served from it, not faulted in again from the kernel."""

from __future__ import annotations

import resource

import numpy as np
import pytest

import pstrain

pytestmark = pytest.mark.timeout(120)

#: A step's arrays, held at once (a batch, its activations, its gradients): 18 MiB.
SIZES = [k << 19 for k in range(1, 9)]
STEPS = 20


def steps_like_training() -> int:
    """Page faults of the thread running it over ``STEPS`` steps that each allocate the
    arrays of ``SIZES``, write them through and free them, as a training step does (two
    steps first, to warm up)."""

    def step() -> None:
        held = []
        for size in SIZES:
            a = np.empty(size, np.uint8)
            a.fill(1)
            held.append(a)

    step()
    step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(STEPS):
        step()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


async def faults_of_a_worker(extra_args: list[str]) -> int:
    async with pstrain.LocalCluster(num_ps=1, num_workers=1, extra_args=extra_args) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        faults = await coordinator.schedule(steps_like_training)
        await coordinator.close()
        return int(faults)


async def test_a_worker_faults_in_a_steps_memory_once_and_keep_freed_0_leaves_malloc_as_it_was():
    step_pages = sum(SIZES) // 4096
    kept = await faults_of_a_worker([])  # a worker keeps 256 MiB by default
    # the warm-up steps faulted the pages in; the next steps reuse them
    assert kept < step_pages, (kept, step_pages)
    returned = await faults_of_a_worker(["--keep-freed", "0"])
    # glibc's own way: a step's arrays go back to the kernel when freed, and come back zeroed
    assert returned > STEPS * step_pages // 2, (returned, step_pages)
