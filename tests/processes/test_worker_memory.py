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


def resident_mib() -> float:
    from pstrain._base.machine import resident_memory

    return resident_memory() / 2**20


async def test_a_worker_sent_a_new_function_every_step_keeps_a_bounded_number_of_them():
    """Each closure a new function capturing its own 1 MiB array (``lambda a=a: ...``, a
    ``functools.partial`` per step): the worker keeps the newest 128 MiB of them, not all."""
    steps = 400
    async with pstrain.LocalCluster(num_ps=1, num_workers=1, extra_args=["--keep-freed", "0"]) as cluster:
        coordinator = pstrain.ClusterCoordinator(pstrain.ParameterServerStrategy(cluster.resolver))
        before = await coordinator.schedule(resident_mib)
        for i in range(steps):
            a = np.full(1 << 17, i, np.float64)
            coordinator.schedule(lambda a=a: float(a[-1]))
            if i % 25 == 24:
                await coordinator.join()
        after = await coordinator.schedule(resident_mib)
        assert await coordinator.schedule(lambda a=a: float(a[0])) == steps - 1
        await coordinator.close()
    # 400 MiB if every function stayed; 128 MiB of them and the allocator's slack here
    assert after - before < 200, (before, after)
