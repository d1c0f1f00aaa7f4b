"""Keep a numpy copy of a dynamic table in step with training, from the ps's serving feed.

Each ps serves the rows of its shard changed since a version::

    GET /v1/tables/<name>/rows?since=<version>     (Authorization: Bearer <token>)

The reply is a safetensors file (``ids``, ``rows``, ``removed``) and the headers
``X-Pstrain-Version`` (send it as ``since`` next time) and ``X-Pstrain-Reset``
(``true``: these rows replace the shard; else drop ``removed``, then put ``ids``
in). Versions are those of the job's checkpoints and deltas, so a serving copy
follows training one delta interval behind
(``CheckpointManager(..., delta_interval_s=...)``).

A ps that cannot be reached (lost, or left the job) keeps serving from its last copy
until the ps that can be reached say, in their replies' ``shard`` and ``num_shards``,
that they hold every slice of the table between them (the lost ps's slices were
restored onto them, or moved there): then its copy is dropped, so no row is held
twice, and it is asked no more.

Run it beside a job whose table is ``emb``::

    PSTRAIN_TOKEN=... python examples/table_feed.py --ps 10.0.0.5:7000,10.0.0.6:7000 --table emb

Only aiohttp, numpy and safetensors are needed: any other language can do the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import aiohttp
import numpy as np
from safetensors.numpy import load


class ShardCopy:
    """One ps's shard: ids (ascending) and their rows, at ``version``; the slices of the
    table's hash space it holds (``slices`` of ``num_slices``, from the reply's metadata)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.ids = np.empty(0, np.int64)
        self.rows = np.empty((0, 0), np.float32)
        self.slices: set[int] = set()
        self.num_slices = 1
        self.down = False  # could not be reached at the last poll

    def holds(self, shard: str, num_shards: int) -> None:
        """The reply's ``shard`` (one number: that shard; else the slices, comma-separated)."""
        self.slices = {int(s) for s in shard.split(",") if s}  # none: it left the job
        self.num_slices = num_shards

    def slices_of(self, num: int) -> set[int]:
        """The slices held, as slices of ``num`` (a multiple of ``num_slices``): shard k
        of n is slices {k, k + n, k + 2n, ...} of any multiple of n."""
        return {s for s in range(num) if s % self.num_slices in self.slices}

    def apply(
        self, reset: bool, version: int, ids: np.ndarray, rows: np.ndarray, removed: np.ndarray
    ) -> None:
        if reset or not self.rows.size:  # nothing held yet: take the rows' width
            self.ids, self.rows = self.ids[:0], np.empty((0, *rows.shape[1:]), rows.dtype)
        keep = ~np.isin(self.ids, np.concatenate([removed, ids]))
        self.ids = np.concatenate([self.ids[keep], ids])  # a reply's ids come in no set order
        self.rows = np.concatenate([self.rows[keep], rows])
        order = np.argsort(self.ids, kind="stable")
        self.ids, self.rows = self.ids[order], self.rows[order]
        self.version = version


def _metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (its 8-byte header length, then JSON)."""
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + n]).get("__metadata__", {})


class TableMirror:
    """A table's rows across every ps, each shard kept at its own version."""

    def __init__(self, endpoints: list[str], table: str, token: str | None = None) -> None:
        self.endpoints = endpoints
        self.table = table
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.shards: list[ShardCopy | None] = [ShardCopy() for _ in endpoints]  # None: dropped
        self.resets = 0  # replies that replaced a whole shard

    async def poll(self, session: aiohttp.ClientSession) -> int:
        """Ask every ps once; returns the rows received. A ps that cannot be reached keeps
        its last copy until the others hold all of the table (then it is dropped)."""
        asked = [k for k, s in enumerate(self.shards) if s is not None]
        received = await asyncio.gather(*(self._poll(session, k) for k in asked))
        self._drop_covered()
        return sum(received)

    async def _poll(self, session: aiohttp.ClientSession, k: int) -> int:
        shard = self.shards[k]
        assert shard is not None
        params = {} if shard.version is None else {"since": str(shard.version)}
        url = f"http://{self.endpoints[k]}/v1/tables/{self.table}/rows"
        try:
            async with session.get(url, params=params, headers=self.headers) as response:
                if response.status == 503 and "Retry-After" in response.headers:
                    return 0  # busy: asked again at the next poll
                if response.status != 200:
                    raise RuntimeError(f"{url}: {response.status} {await response.text()}")
                body = await response.read()
                headers = response.headers
        except aiohttp.ClientConnectionError:
            shard.down = True  # lost, or left the job: its copy serves until others cover it
            return 0
        shard.down = False
        arrays = load(body)
        shard.apply(
            headers["X-Pstrain-Reset"] == "true",
            int(headers["X-Pstrain-Version"]),
            arrays["ids"],
            arrays["rows"],
            arrays["removed"],
        )
        metadata = _metadata(body)
        shard.holds(metadata["shard"], int(metadata["num_shards"]))
        self.resets += headers["X-Pstrain-Reset"] == "true"
        return int(arrays["ids"].size)

    def _drop_covered(self) -> None:
        """Drop the copies of the ps that cannot be reached once the others hold every slice."""
        up = [s for s in self.shards if s is not None and not s.down and s.version is not None]
        down = [k for k, s in enumerate(self.shards) if s is not None and s.down]
        if not down or not up:
            return
        num = max(s.num_slices for s in up)
        if all(num % s.num_slices == 0 for s in up) and set().union(*(s.slices_of(num) for s in up)) == set(
            range(num)
        ):
            for k in down:
                self.shards[k] = None  # its rows are the others' now

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Every id (ascending) and its row."""
        held = [s for s in self.shards if s is not None and s.version is not None]
        if not held:  # (no reply yet: the rows' width is not known)
            return np.empty(0, np.int64), np.empty((0, 0), np.float32)
        ids = np.concatenate([s.ids for s in held])
        rows = np.concatenate([s.rows for s in held])
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order]

    def lookup(self, ids: np.ndarray, default: float = 0.0) -> np.ndarray:
        """The rows of ``ids`` (``default`` for ids the table does not hold)."""
        have, rows = self.snapshot()
        ids = np.asarray(ids, np.int64).reshape(-1)
        at = np.searchsorted(have, ids)
        found = at < have.size
        found[found] = have[at[found]] == ids[found]
        out = np.full((ids.size, rows.shape[1]), default, rows.dtype)
        out[found] = rows[at[found]]
        return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ps", required=True, help="the ps's host:port, comma-separated, in order")
    parser.add_argument("--table", required=True, help="the table's name")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between polls")
    parser.add_argument("--token-file", help="the cluster token (default: $PSTRAIN_TOKEN)")
    args = parser.parse_args()
    token = os.environ.get("PSTRAIN_TOKEN")
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    mirror = TableMirror(args.ps.split(","), args.table, token)
    async with aiohttp.ClientSession() as session:
        while True:
            rows = await mirror.poll(session)
            ids, _ = mirror.snapshot()
            versions = [s.version if s is not None else "dropped" for s in mirror.shards]
            print(f"{ids.size} rows held, {rows} received, versions {versions}", flush=True)
            await asyncio.sleep(args.every)


if __name__ == "__main__":
    asyncio.run(main())
