"""Where W8 should pool: on the worker (the distinct rows travel, the worker sums them into
bags) or on the ps (the ids and bags travel, each ps sums the rows it holds into partial
bags, the worker adds the partials). Measured on W8's tables and batches, 2 ps, in rounds
that alternate the two; the figure is each way's bytes and requests per lookup and its
time per lookup (medians).

Pooling on the ps runs as a function the ps executes next to the tables (``vars/call``,
one request per ps carrying every table part it holds): the same request count as the
collection's lookup. The backward of each way moves what its forward moved, mirrored:
the distinct rows' gradients, or the bags' gradients (one per bag per ps that holds a
part of the table), so the forward's bytes are doubled for a step's figure.

    python benchmarks/pooling_placement.py [--rounds 5] [--lookups 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import pstrain
from pstrain._embeddings.pooling import Bags
from pstrain._formats.messages.operations import CallVariables
from pstrain._variables.batched import ensure_created

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import dlrm  # noqa: E402
from common import emit  # noqa: E402


def pool_here(*arrays_and_args: Any) -> list[np.ndarray]:
    """Runs on a ps: for each table part, the bags' partial sums of the rows it holds (by the
    compiled loop the worker's pooling uses)."""
    from pstrain._kernels import KERNELS  # the ps's own

    n = len(arrays_and_args) // 2
    arrays, plans = arrays_and_args[:n], arrays_and_args[n:]
    out = []
    for table, (local, segments, bags) in zip(arrays, plans):
        partial = np.zeros((bags, table.shape[1]), table.dtype)
        KERNELS.pool_rows(partial, segments, table, local.astype(np.int64), np.ones(local.size, table.dtype))
        out.append(partial)
    return out


async def on_ps(collection: Any, batch: Any) -> np.ndarray:
    """Every feature's bags pooled on the ps (partial sums per part), added on the worker."""
    per_ps: dict[int, list[tuple[Any, Any, int]]] = {}
    for f, name in collection.feature_tables.items():
        table = collection.tables[name]
        jt = batch[f]
        segments = jt.segment_ids()
        parts = table.variables if isinstance(table, pstrain.ShardedVariable) else [table]
        offsets = table.offsets if isinstance(table, pstrain.ShardedVariable) else [0, table.shape[0]]
        which = np.searchsorted(np.asarray(offsets)[1:], jt.values, side="right")
        for p, part in enumerate(parts):
            mask = which == p
            if mask.any():
                plan = ((jt.values[mask] - offsets[p]).astype(np.int32), segments[mask], len(jt))
                per_ps.setdefault(part.ps_index, []).append((f, part, plan))
    await ensure_created([part for items in per_ps.values() for _, part, _ in items])
    pooled = {f: np.zeros((len(batch[f]), dlrm.DIM), np.float32) for f in collection.feature_tables}

    async def ask(items: list[tuple[Any, Any, Any]]) -> None:
        parts = [part for _, part, _ in items]
        reply = (
            await parts[0]
            .channel()
            .request(
                CallVariables(
                    fn=pool_here, vars=[p.key for p in parts], args=tuple(plan for _, _, plan in items)
                )
            )
        )
        for (f, _, _), partial in zip(items, reply.result):
            pooled[f] += partial

    await asyncio.gather(*(ask(items) for items in per_ps.values()))
    return np.concatenate([pooled[f] for f in collection.feature_tables], axis=1)


async def measure(rounds: int, lookups: int) -> dict[str, Any]:
    (ids, lengths, _, _), _ = dlrm.synthetic(lookups * dlrm.BATCH, 0)
    kjt = dlrm.features(ids, lengths)
    batches = [kjt.take(np.arange(i * dlrm.BATCH, (i + 1) * dlrm.BATCH)) for i in range(lookups)]
    figures: dict[str, dict[str, list[float]]] = {
        w: {"ms": [], "bytes": [], "requests": []} for w in ("worker", "ps")
    }
    async with pstrain.LocalCluster(num_ps=2, num_workers=1) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        async with strategy.scope():
            model = dlrm.DLRM()
        collection = model.embeddings
        first = await collection.lookup(batches[0])
        check = await on_ps(collection, batches[0])
        np.testing.assert_allclose(check, first.concat(), rtol=1e-5, atol=1e-6)  # the same bags
        for r in range(rounds):
            for way in ("worker", "ps") if r % 2 == 0 else ("ps", "worker"):
                with pstrain.count_requests() as counts:
                    t0 = time.perf_counter()
                    for b in batches:
                        if way == "worker":
                            pooled = await collection.lookup(b)
                            pooled.concat()
                        else:
                            await on_ps(collection, b)
                    elapsed = time.perf_counter() - t0
                figures[way]["ms"].append(elapsed * 1e3 / lookups)
                figures[way]["bytes"].append((counts.bytes_sent + counts.bytes_received) / lookups)
                figures[way]["requests"].append(counts.requests / lookups)
        await strategy.flush()
    unique = float(np.mean([sum(Bags(b[f], "sum").unique.size for f in dlrm.FEATURES) for b in batches]))
    out: dict[str, Any] = {
        "distinct_rows_per_lookup": round(unique),
        "rounds": rounds,
        "lookups_per_round": lookups,
        "batch": dlrm.BATCH,
    }
    for way, fig in figures.items():
        out[f"pool_on_{way}_ms_per_lookup"] = round(statistics.median(fig["ms"]), 2)
        out[f"pool_on_{way}_bytes_per_lookup"] = round(statistics.median(fig["bytes"]))
        out[f"pool_on_{way}_bytes_per_step"] = 2 * out[f"pool_on_{way}_bytes_per_lookup"]
        out[f"pool_on_{way}_requests_per_lookup"] = statistics.median(fig["requests"])
    out["chosen"] = (
        "worker"
        if (
            out["pool_on_worker_bytes_per_lookup"] <= out["pool_on_ps_bytes_per_lookup"]
            and out["pool_on_worker_ms_per_lookup"] <= out["pool_on_ps_ms_per_lookup"]
        )
        else "measure per table"
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lookups", type=int, default=20)
    args = parser.parse_args()
    row = pstrain.run(measure(args.rounds, args.lookups))
    emit({"metric": "pooling_placement", "ps": 2, **row}, "W8-pooling")


if __name__ == "__main__":
    main()
