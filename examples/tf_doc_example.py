"""TensorFlow's ParameterServerStrategy documentation example, with `await`.

Runs on its own (starts a LocalCluster of 2 ps and 2 workers) or under
`pstrain launch --ps 2 --workers 2 -- python examples/tf_doc_example.py`.
"""

from __future__ import annotations

import os

import pstrain


async def train(resolver: pstrain.ClusterResolver) -> None:
    strategy = pstrain.ParameterServerStrategy(resolver)
    coordinator = pstrain.ClusterCoordinator(strategy)
    with strategy.scope():
        v1 = pstrain.Variable(initial_value=0.0)
        v2 = pstrain.Variable(initial_value=1.0)

    async def worker_fn():
        await v1.assign_add(0.1)
        await v2.assign_sub(0.2)
        return await v1.read_value() / await v2.read_value()

    result = coordinator.schedule(worker_fn)
    assert await result == 0.125
    for _ in range(10):
        result = coordinator.schedule(worker_fn)
    await coordinator.join()
    print(f"v1 = {await v1.numpy():.4f}, v2 = {await v2.numpy():.4f}, last result = {await result:.4f}")
    await coordinator.close()


async def main() -> None:
    if os.environ.get("PSTRAIN_CONFIG") or os.environ.get("TF_CONFIG"):
        await train(pstrain.TFConfigClusterResolver())
    else:
        async with pstrain.LocalCluster(num_ps=2, num_workers=2) as cluster:
            await train(cluster.resolver)


if __name__ == "__main__":
    pstrain.run(main())
