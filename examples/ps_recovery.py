"""Recovering from the loss of a parameter server in the same coordinator process.

A ps that dies takes its variables with it: the next join() raises
UnavailableError naming it. Restart the ps (your cluster manager does this;
here LocalCluster.restart), restore the latest checkpoint, which re-creates
the lost variables on the fresh ps, and go on training.
"""

import tempfile

import numpy as np

import pstrain
from pstrain.checkpoint import Checkpoint, CheckpointManager


async def main():
    run_dir = tempfile.mkdtemp()  # the ps read and write checkpoints only under their root
    async with pstrain.LocalCluster(num_ps=2, num_workers=2, checkpoint_root=run_dir) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        coordinator = pstrain.ClusterCoordinator(strategy)
        async with strategy.scope():
            w = pstrain.Variable(np.zeros(4, np.float32), name="w")
            b = pstrain.Variable(np.zeros(4, np.float32), name="b")
            opt = pstrain.optimizers.SGD(0.1)
        manager = CheckpointManager(Checkpoint(w=w, b=b, optimizer=opt), run_dir)

        async def step():
            await opt.apply_gradients([(np.ones(4, np.float32), w), (np.ones(4, np.float32), b)])

        for _ in range(10):
            coordinator.schedule(step)
        await coordinator.join()
        await manager.save()

        await cluster.kill("ps", 1)  # the machine holding `b` is preempted
        coordinator.schedule(step)
        try:
            await coordinator.join()
        except pstrain.errors.UnavailableError as exc:
            print("lost:", exc.task)  # /job:ps/replica:0/task:1

        await cluster.restart("ps", 1)
        await manager.restore_or_initialize()  # re-creates `b` and its slots on the new ps
        for _ in range(10):
            coordinator.schedule(step)
        await coordinator.join()
        print("iterations:", await opt.iterations.numpy(), "b:", await b.numpy())
        await coordinator.close()


if __name__ == "__main__":
    pstrain.run(main())
