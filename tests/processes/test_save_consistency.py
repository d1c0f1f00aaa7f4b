"""A full checkpoint written while updates go on holds each ps at one moment: an
``opt/apply`` that updates a variable and a dynamic table's rows on a ps is in both of
that ps's files or in neither (a restore of such a save is the state after a whole number
of steps, as the SIGKILL drill needs of a compaction's base). Real ps processes: in one
process the two requests a save used to send a ps arrived back to back and hid the gap."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import pstrain
from pstrain._formats.numerics.idhash import shard_of
from pstrain.checkpoint import Checkpoint, load_variables

pytestmark = pytest.mark.timeout(60)

SAVES = 25


async def test_a_save_during_updates_holds_each_ps_at_one_moment(tmp_path, drill):
    cluster = await drill.cluster(num_ps=2, num_workers=1, checkpoint_root=tmp_path)
    strategy = pstrain.ParameterServerStrategy(cluster.resolver)
    with strategy.scope():
        counts = [pstrain.Variable(np.zeros(1, np.float32), name=f"count{p}") for p in range(2)]
        table = pstrain.DynamicEmbedding(1, name="emb", initializer=pstrain.initializers.Zeros())
        opt = pstrain.optimizers.SGD(1.0)
    assert [c.ps_index for c in counts] == [0, 1]
    first = {}  # one id held by each ps
    for i in range(100):
        first.setdefault(int(shard_of(np.array([i]), 2)[0]), i)
    ids = np.array(sorted(first.values()), np.int64)
    ckpt = Checkpoint(counts=counts, emb=table, optimizer=opt)
    steps = 0
    stop = asyncio.Event()

    async def updates() -> None:  # one opt/apply per ps: its count and its id, +1 each
        nonlocal steps
        while not stop.is_set():
            await table.lookup(ids)
            await opt.apply_gradients(
                [(np.full(1, -1.0, np.float32), c) for c in counts]
                + [(pstrain.IndexedSlices(np.full((ids.size, 1), -1.0, np.float32), ids), table)]
            )
            steps += 1

    runners = [asyncio.create_task(updates()) for _ in range(4)]
    try:
        caught = []
        for k in range(SAVES):
            path = await ckpt.write(str(tmp_path / f"save-{k}"))
            saved = load_variables(path)
            row_of = dict(zip(saved["emb/ids"].tolist(), saved["emb/rows"][:, 0].tolist()))
            for p, i in first.items():
                count = float(saved[f"counts/{p}"][0])
                assert row_of.get(i, 0.0) == count, (k, p, count, row_of.get(i))
            caught.append(float(saved["counts/0"][0]))
    finally:
        stop.set()
        await asyncio.gather(*runners)
    assert steps > 0 and len(set(caught)) > 1, caught  # saves caught updates under way
