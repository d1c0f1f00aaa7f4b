"""Fault drill: W4 training while one worker is SIGKILLed twice and restarted.

Every scheduled step is accounted for: each RemoteValue resolves, and the
optimizer's ``iterations`` ends at least at the number of steps scheduled
(a step whose worker died mid-way runs again: at least once, never lost).

    python examples/fault_drill.py [--steps 300] [--framework jax]

``--framework jax`` or ``torch`` drills the same model written in that framework
(``ctr_jax.py``, ``ctr_torch.py``): a worker dies in the middle of a compiled
JAX step, and its restarted process compiles again.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys

import numpy as np

import pstrain
from pstrain.ctr import BATCH, synthetic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the models of ctr_embedding.py
from ctr_embedding import FRAMEWORKS  # noqa: E402

STALL_S = 60.0  # a drill that makes no progress this long fails, saying where it stood


async def drill(steps: int, quiet: bool = False, framework: str = "numpy") -> dict:
    async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        coordinator = pstrain.ClusterCoordinator(strategy)
        step, held_out_loss, opt = await importlib.import_module(FRAMEWORKS[framework]).build(strategy)

        def dataset_fn():
            (ids, dense_x, y), _ = synthetic(steps * BATCH, 0)
            return (
                pstrain.data.Dataset.from_tensor_slices((ids, dense_x, y))
                .shuffle(10_000)
                .repeat()
                .batch(BATCH)
            )

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
        rvs = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
        kills = 0
        for fraction in (0.25, 0.6):
            deadline = asyncio.get_running_loop().time() + STALL_S
            while sum(rv.done() for rv in rvs) < steps * fraction:
                if asyncio.get_running_loop().time() > deadline:  # say what the job looks like
                    raise RuntimeError(
                        f"no {fraction:.0%} of the steps within {STALL_S:g} s "
                        f"({sum(rv.done() for rv in rvs)} done): workers {coordinator.membership()}, "
                        f"{coordinator.statistics()}"
                    )
                await asyncio.sleep(0.05)
            await cluster.kill("worker", 1)
            kills += 1
            if not quiet:
                print(f"killed worker 1 after {sum(rv.done() for rv in rvs)} steps; restarting it")
            await cluster.restart("worker", 1)
        try:
            await asyncio.wait_for(coordinator.join(), 2 * STALL_S)
        except TimeoutError:
            raise RuntimeError(
                f"the steps did not finish within {2 * STALL_S:g} s: workers "
                f"{coordinator.membership()}, {coordinator.statistics()}"
            ) from None
        losses = [await rv for rv in rvs]
        iterations = int(await opt.iterations.numpy())
        _, test = synthetic(steps * BATCH)
        held_out = await held_out_loss(test)
        result = {
            "scheduled": steps,
            "resolved": len(losses),
            "iterations": iterations,
            "kills": kills,
            "worker_failures": coordinator.worker_failures,
            "retried": coordinator.closures_retried,
            "held_out_log_loss": held_out,
            "final_train_loss": float(np.mean(losses[-20:])),
        }
        if not quiet:
            print(
                f"{steps} steps scheduled, {len(losses)} resolved, iterations {iterations} "
                f"(>= {steps}), {coordinator.worker_failures} worker failures seen, "
                f"{coordinator.closures_retried} closures rerun, held-out log loss {held_out:.4f}"
            )
        await coordinator.close()
        return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), default="numpy")
    args = parser.parse_args()
    r = pstrain.run(drill(args.steps, args.quiet, args.framework))
    sys.exit(0 if r["resolved"] == r["scheduled"] and r["iterations"] >= r["scheduled"] else 1)
