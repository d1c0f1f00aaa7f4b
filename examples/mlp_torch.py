"""W3's MLP as a ``torch.nn.Module`` whose parameters live on the ps (``pstrain.torch``).

Same data, initial weights and optimizer as ``mnist_mlp.py`` (run it with
``--framework torch``); autograd computes the gradients.
"""

from __future__ import annotations

import numpy as np
import torch
from mnist_mlp import glorot

import pstrain
import pstrain.torch as ptorch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 256)
        self.fc2 = torch.nn.Linear(256, 10)
        rng = np.random.default_rng(1)  # the numpy model's initial weights
        with torch.no_grad():
            self.fc1.weight.copy_(torch.from_numpy(glorot(rng, 784, 256).T.copy()))
            self.fc2.weight.copy_(torch.from_numpy(glorot(rng, 256, 10).T.copy()))
            self.fc1.bias.zero_()
            self.fc2.bias.zero_()

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


async def build(strategy):
    net = Net()
    async with strategy.scope():
        remote = ptorch.RemoteModule(net, name="mlp")
        opt = pstrain.optimizers.SGD(learning_rate=0.1)

    async def step(it):
        x, y = next(it)
        await remote.pull()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        await opt.apply_gradients(remote.gradients())
        return loss.item()

    async def predict_labels(x):
        await remote.pull()
        with torch.no_grad():
            return net(torch.from_numpy(np.asarray(x, np.float32))).argmax(1).numpy()

    return step, predict_labels


if __name__ == "__main__":  # run alone, this model trains in mnist_mlp.py's job
    import runpy
    import sys
    from pathlib import Path

    sys.argv[1:1] = ["--framework", "torch"]
    runpy.run_path(str(Path(__file__).with_name("mnist_mlp.py")), run_name="__main__")
