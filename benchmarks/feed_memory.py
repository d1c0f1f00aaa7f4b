"""The serving feed's memory under readers that ask and never read (issue: 16 requests of
about 150 bytes took a ps from 117 MiB to 796 MiB for 24 MiB of rows).

One ps process (``LocalCluster``) holds a dynamic table of about 24 MiB of rows, saved
once; then ``--readers`` connections each ask for the whole shard (``since`` a version
that is not one: a reset) and read nothing. The ps's resident memory is sampled every
50 ms for ``--hold`` seconds; the line written to ``results/feed_memory.jsonl`` gives it
before, at its peak, the answers the readers got (200 or 503), and the rows' bytes.

    python benchmarks/feed_memory.py [--readers 16] [--hold 5] [--mib 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

import pstrain

RESULTS = Path(__file__).resolve().parent / "results" / "feed_memory.jsonl"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


async def main(args: argparse.Namespace) -> None:
    root = tempfile.mkdtemp(prefix="pstrain-feed-memory-")
    async with pstrain.LocalCluster(num_ps=1, num_workers=1, checkpoint_root=root) as cluster:
        strategy = pstrain.ParameterServerStrategy(cluster.resolver)
        with strategy.scope():
            table = pstrain.DynamicEmbedding(64, name="emb", capacity=2 * args.mib * 4096)
        rows = args.mib * (1 << 20) // (64 * 4)
        for lo in range(0, rows, 20_000):
            await table.lookup(np.arange(lo, min(rows, lo + 20_000), dtype=np.int64))
        await pstrain.checkpoint.CheckpointManager(pstrain.Checkpoint(table=table), root).save()
        pid = cluster.pid("ps", 0)
        assert pid is not None
        address = cluster.cluster_spec.task_address("ps", 0)
        host, port = address.rsplit(":", 1)
        before = _rss(pid)
        request = (
            f"GET /v1/tables/emb/rows?since=987654321 HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {cluster.token}\r\n\r\n"
        ).encode()
        peaks, statuses = [], []
        for _ in range(args.rounds):  # each round: readers that ask, hold, then go
            readers = []
            for _ in range(args.readers):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(request)
                readers.append((reader, writer))
            peak, end = before, time.monotonic() + args.hold
            while time.monotonic() < end:
                peak = max(peak, _rss(pid))
                await asyncio.sleep(0.05)
            peaks.append(peak)
            for reader, writer in readers:
                line = await asyncio.wait_for(reader.readline(), 10)
                statuses.append(int(line.split()[1]))
                writer.transport.abort()
        result = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "readers": args.readers,
            "rounds": args.rounds,
            "rows_mib": round(rows * 64 * 4 / (1 << 20), 1),
            "rss_before_mib": round(before / (1 << 20), 1),
            "rss_peak_mib_by_round": [round(p / (1 << 20), 1) for p in peaks],
            "grown_mib": round((max(peaks) - before) / (1 << 20), 1),
            "answered_200": statuses.count(200),
            "answered_503": statuses.count(503),
        }
    print(json.dumps(result))
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--hold", type=float, default=5.0)
    parser.add_argument("--mib", type=int, default=24, help="the table's rows, in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    os.environ.setdefault("PSTRAIN_LOG_LEVEL", "WARNING")
    asyncio.run(main(parser.parse_args()))
