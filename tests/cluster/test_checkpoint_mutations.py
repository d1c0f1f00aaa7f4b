"""A real checkpoint's files changed a few bytes at a time, then read back: each read fails
with a clear error or gives exactly the undamaged checkpoint's values, never others.

The checkpoint is a base and two deltas of two variables (one row-sharded and tracked by
rows), a dynamic table with evictions and a table made after the base. Each case changes,
deletes or inserts 1 to 3 bytes of one file, most often in a safetensors header or an
index (the data is covered by the files' checksums; the headers and the indexes are where
damage could once be read as another checkpoint: a renamed checksum, a digit of an offset
one bit off). The runs that found those read thousands of cases; this keeps a sample.
"""

from __future__ import annotations

import glob
import os
import random
import shutil

import numpy as np
import pytest

import pstrain
from pstrain.checkpoint import load_variables
from pstrain.errors import InvalidArgumentError, NotFoundError
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN

pytestmark = pytest.mark.timeout(120)

CASES = 300


async def _checkpoint(root: str) -> str:
    """The checkpoint (module docstring); the last delta's path."""
    async with InProcessCluster(
        num_ps=2, num_workers=1, token=TOKEN, ps_options={"checkpoint_root": root}
    ) as cluster:
        strategy = pstrain.ParameterServerStrategy(
            cluster.resolver, variable_partitioner=pstrain.partitioners.FixedShardsPartitioner(2)
        )
        with strategy.scope():
            w = pstrain.Variable(np.arange(64, dtype=np.float32).reshape(-1, 4), name="w")
            big = pstrain.Variable(np.zeros((70_000, 4), np.float32), name="big")  # tracked by rows
            table = pstrain.DynamicEmbedding(4, name="emb", capacity=200)
            opt = pstrain.optimizers.Adagrad(0.1)
        ckpt = pstrain.Checkpoint(w=w, big=big, table=table, opt=opt)
        manager = pstrain.checkpoint.CheckpointManager(ckpt, root)
        ids = np.arange(150, dtype=np.int64)
        rows = await table.lookup(ids)
        await opt.apply_gradients([(pstrain.IndexedSlices(np.ones_like(rows), ids), table)])
        await manager.save()
        with strategy.scope():
            born = pstrain.DynamicEmbedding(4, name="born")
        ckpt.born = born
        await born.lookup(np.arange(20, dtype=np.int64))
        await table.lookup(np.arange(100, 260, dtype=np.int64))  # past its capacity: evictions
        grad = np.ones((3, 4), np.float32)
        await opt.apply_gradients([(pstrain.IndexedSlices(grad, np.array([5, 3000, 69_999])), big)])
        await manager.save_delta()
        await table.lookup(np.arange(300, 360, dtype=np.int64))
        await born.lookup(np.arange(15, 30, dtype=np.int64))
        await w.assign_add(np.ones((16, 4), np.float32))
        delta = await manager.save_delta()
        await manager.close()
        return str(delta)


def _mutate(rng: random.Random, path: str) -> None:
    """Change, delete or insert 1 to 3 bytes of ``path``, in its header or index most often."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    head = len(data)
    if path.endswith(".safetensors"):
        head = min(len(data), 8 + int.from_bytes(data[:8], "little"))
    for _ in range(rng.randint(1, 3)):
        head = max(1, min(head, len(data)))
        at = rng.randrange(head) if rng.random() < 0.7 else rng.randrange(len(data))
        kind = rng.random()
        if kind < 0.6:
            data[at] ^= 1 << rng.randrange(8)
        elif kind < 0.8:
            del data[at : at + rng.randint(1, 8)]
        else:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    with open(path, "wb") as f:
        f.write(bytes(data))


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


async def test_a_damaged_checkpoint_reads_as_an_error_or_as_it_was(tmp_path):
    base = str(tmp_path / "base")
    os.makedirs(base)
    delta = os.path.basename(await _checkpoint(base))
    want = load_variables(os.path.join(base, delta))
    assert {"born/ids", "big", "table/ids"} <= want.keys()
    rng = random.Random(7)
    refused = 0
    for case in range(CASES):
        work = str(tmp_path / f"case{case}")
        shutil.copytree(base, work)
        path = rng.choice(sorted(glob.glob(os.path.join(work, "*"))))
        _mutate(rng, path)
        try:
            got = load_variables(os.path.join(work, delta))
        except (InvalidArgumentError, NotFoundError):
            refused += 1
        else:
            assert _same(got, want), f"case {case}: {os.path.basename(path)} read as other values"
        shutil.rmtree(work)
    assert refused > CASES // 2  # (most changes are damage the reads see)
