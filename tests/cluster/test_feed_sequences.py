"""The serving feed followed through random sequences of what a job does to a table:
training steps that evict (a capacity), full saves, deltas, compactions and saves pruned
(``max_to_keep``), with the reader polling at random moments, so that it is sometimes many
versions behind, or behind a version no longer kept, and sometimes while a save is being
written and the oldest pruned. After every poll made between saves the reader holds
exactly the table's rows as of the last save (a poll during a save may give either
version: the next poll must still bring the reader to the last one), on ps that hold the
table in RAM or tiered under a budget."""

from __future__ import annotations

import asyncio
import os
import random

import aiohttp
import numpy as np
import pytest

import pstrain
from pstrain.testing import InProcessCluster
from tests.helpers import TOKEN, table_feed_example

pytestmark = pytest.mark.timeout(180)

DIM = 16
table_feed = table_feed_example()


def _cluster(tmp_path, tiered: bool) -> InProcessCluster:
    options = {"checkpoint_root": str(tmp_path)}
    if tiered:  # a hot set of a few hundred rows a ps: most of the table on disk
        options |= {"memory_budget": 1 << 20, "table_dir": str(tmp_path / "tier"), "table_segment_rows": 64}
    return InProcessCluster(num_ps=2, num_workers=1, token=TOKEN, ps_options=options)


@pytest.mark.parametrize("tiered", [False, True], ids=["ram", "tiered"])
@pytest.mark.parametrize("seed", range(int(os.environ.get("PSTRAIN_FEED_SEEDS", 4))))
async def test_a_reader_polling_at_random_holds_each_saved_version(tmp_path, seed, tiered):
    rng = random.Random(seed)
    done: list[str] = []  # what the sequence did, for the failure's message
    async with _cluster(tmp_path, tiered) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(DIM, name="emb", capacity=[None, 2500][seed % 2])
            opt = pstrain.optimizers.Adagrad(0.1)
        manager = pstrain.checkpoint.CheckpointManager(
            pstrain.Checkpoint(model={"emb": table}, optimizer=opt),
            str(tmp_path / "ckpt"),
            max_to_keep=2,
            deltas_per_base=rng.choice([2, 5]),
        )
        mirror = table_feed.TableMirror([ps.address for ps in cluster.ps], "emb", TOKEN)
        saved: tuple[np.ndarray, np.ndarray] | None = None
        async with aiohttp.ClientSession() as session:
            for k in range(40):
                op = rng.choices(
                    ["step", "save", "delta", "compact", "poll", "poll-while-saving"], [5, 1, 3, 1, 3, 2]
                )[0]
                done.append(op)
                if op == "step":
                    ids = np.unique(
                        np.array([rng.randrange(0, 20_000) for _ in range(rng.randrange(1, 800))])
                    )
                    rows = await table.lookup(ids)
                    grad = np.tanh(rows + np.sin(ids + k)[:, None]).astype(np.float32)
                    await opt.apply_gradients([(pstrain.IndexedSlices(grad, ids), table)])
                elif op == "poll-while-saving" and saved is not None:
                    # a reply read while a save is written and the oldest pruned: any version
                    # it gives is followed from by the next poll (checked there)
                    save = rng.choice([manager.save, manager.save_delta, manager.compact])
                    await asyncio.gather(mirror.poll(session), save())
                    saved = await table.export()
                elif op in ("save", "delta", "compact"):
                    if op == "save" or saved is None:
                        await manager.save()
                    elif op == "delta":
                        await manager.save_delta()
                    else:
                        await manager.compact()
                    saved = await table.export()
                elif op == "poll" and saved is not None:
                    await mirror.poll(session)
                    got_ids, got_rows = mirror.snapshot()
                    np.testing.assert_array_equal(got_ids, saved[0], err_msg=f"ids after {done}")
                    np.testing.assert_array_equal(got_rows, saved[1], err_msg=f"rows after {done}")
            await manager.close()
