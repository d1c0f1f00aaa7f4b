"""The coordinator of examples/slurm/train.sbatch: the cluster comes from SLURM."""

import json
import os

import numpy as np

import pstrain


async def main():
    jobs = dict((k, int(v)) for k, v in (p.split("=") for p in os.environ["PSTRAIN_SLURM_JOBS"].split(",")))
    resolver = pstrain.SlurmClusterResolver(jobs=jobs, port_base=8888)
    print("cluster:", json.dumps(resolver.cluster_spec().as_dict()), flush=True)
    strategy = pstrain.ParameterServerStrategy(resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        w = pstrain.Variable(np.zeros(10, np.float32), name="w")
    for _ in range(100):
        coordinator.schedule(lambda: w.assign_add(np.ones(10, np.float32)))
    await coordinator.join()
    print("w =", await w.numpy())
    # The servers of the step leave (they run with --slurm-jobs, hence --exit-on-shutdown):
    # every task ends, and the SLURM job ends COMPLETED instead of at its time limit.
    await coordinator.shutdown_cluster()
    await coordinator.close()


if __name__ == "__main__":
    pstrain.run(main())
