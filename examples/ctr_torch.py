"""W4's CTR model as a ``torch.nn.Module`` whose parameters live on the ps (``pstrain.torch``).

The same table (generated on the ps from the same seeded initializer), layers,
initial weights, data and Adagrad as the hand-written numpy model
(``pstrain/ctr.py``); run it with ``python examples/ctr_embedding.py
--framework torch``. ``ptorch.Embedding`` gathers only the batch's unique rows;
autograd's gradient for them goes back as IndexedSlices.
"""

from __future__ import annotations

import numpy as np
import torch

import pstrain
import pstrain.torch as ptorch
from pstrain.ctr import DENSE, DIM, FEATURES, HIDDEN, ROWS, log_loss
from pstrain.initializers import RandomUniform


class CTRNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ptorch.Embedding(ROWS, DIM, RandomUniform(-0.05, 0.05, seed=0), name="ctr/embedding")
        width = FEATURES * DIM + DENSE
        self.fc1 = torch.nn.Linear(width, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, 1)
        rng = np.random.default_rng(1)  # the numpy model's initial weights
        limit1, limit2 = np.sqrt(6 / (width + HIDDEN)), np.sqrt(6 / (HIDDEN + 1))
        with torch.no_grad():
            self.fc1.weight.copy_(
                torch.from_numpy(rng.uniform(-limit1, limit1, (width, HIDDEN)).T.astype(np.float32))
            )
            fc2 = rng.uniform(-limit2, limit2, (HIDDEN, 1)).T.astype(np.float32)
            self.fc2.weight.copy_(torch.from_numpy(fc2))
            self.fc1.bias.zero_()
            self.fc2.bias.zero_()

    def forward(self, ids, dense_x):
        x = torch.cat([self.emb(ids).reshape(len(dense_x), -1), dense_x], dim=1)
        return self.fc2(torch.relu(self.fc1(x)))[:, 0]


async def build(strategy):
    async with strategy.scope():
        net = CTRNet()  # its table is created on the ps
        remote = ptorch.RemoteModule(net, name="ctr")
        opt = pstrain.optimizers.Adagrad(learning_rate=0.05, initial_accumulator_value=0.1)

    async def step(it):
        ids, dense_x, y = next(it)
        async with remote.replica({"emb": ids}) as model:  # a module of its own: steps overlap
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(ids, torch.from_numpy(dense_x)), torch.from_numpy(y)
            )
            loss.backward()
            grads = remote.gradients(model)
        await opt.apply_gradients(grads)
        return loss.item()

    async def held_out_loss(test):
        ids, dense_x, y = test
        await remote.pull({net.emb: ids})
        with torch.no_grad():
            p = torch.sigmoid(net(ids, torch.from_numpy(dense_x))).numpy()
        return log_loss(p, y)

    return step, held_out_loss, opt


if __name__ == "__main__":  # run alone, this model trains in ctr_embedding.py's job
    import runpy
    import sys
    from pathlib import Path

    sys.argv[1:1] = ["--framework", "torch"]
    runpy.run_path(str(Path(__file__).with_name("ctr_embedding.py")), run_name="__main__")
