"""A restore all or nothing across the ps: every ps reads and checks its part (variables
and dynamic tables' shards) and holds it as a *stage*; only once every ps has staged its
part does any commit, and if one fails, every ps drops its stage and nothing changes
anywhere.

A table's capacity is shared as a total: each ps's shard gets at least the rows it
restored, the rest of the capacity spread by the shards' shares, so a save of a nearly
full table restores into any number of ps (ids hash unevenly: a shard of a 3-ps restore
of a 2-ps save may hold more than a third of the rows).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Protocol

from .._base.errors import InvalidArgumentError
from .._formats.messages.checkpoint_operations import (
    AbortRestore,
    CommitRestore,
    RestoreCheckpoint,
    RestoreSpec,
    RestoreTable,
)
from .._transport.channels import Channel
from .placement import fences_first

__all__ = ["StagedTable", "new_stage", "restore_staged", "share_capacity"]


class StagedTable(Protocol):
    """What a restore needs of a dynamic table: its key, capacity and channels."""

    key: str
    capacity: int | None

    def channel(self, ps: int) -> Channel: ...


def new_stage() -> str:
    return secrets.token_hex(8)


def share_capacity(
    capacity: int | None, shares: dict[int, int | None], rows: dict[int, int], name: str
) -> dict[int, int | None]:
    """Each ps's share of a table's ``capacity`` once it holds ``rows[ps]`` restored rows:
    at least those rows, the rest spread in proportion to ``shares`` (each ps's share
    before), adding up to ``capacity``.

    >>> share_capacity(2000, {0: 667, 1: 667, 2: 666}, {0: 678, 1: 650, 2: 651}, "t")
    {0: 686, 1: 657, 2: 657}
    """
    if capacity is None:
        return dict.fromkeys(rows)
    total = sum(rows.values())
    if total > capacity:
        raise InvalidArgumentError(
            f"restore of table {name!r}: the save holds {total} rows, more "
            f"than the table's capacity of {capacity}"
        )
    spare = capacity - total
    weights = {ps: shares.get(ps) or 1 for ps in rows}
    weight = sum(weights.values())
    out = {ps: rows[ps] + spare * weights[ps] // weight for ps in rows}
    for ps in sorted(rows, key=lambda p: (-weights[p], p))[: capacity - sum(out.values())]:
        out[ps] += 1
    return {ps: max(1, n) for ps, n in out.items()}


async def restore_staged(
    variables: dict[Channel, list[RestoreSpec]],
    tables: list[tuple[StagedTable, dict[int, RestoreTable], dict[int, int | None]]],
    stage: str,
) -> dict[Channel, Any]:
    """Stage ``variables`` (by the channel of the ps holding them) and each table's
    requests (``(table, {ps: RestoreTable with this stage}, {ps: its share before})``) on
    every ps, then commit them everywhere with each table's capacity shared as a total;
    on any failure, abort everywhere and raise it. Returns each channel's commit reply."""
    channels: dict[Channel, None] = dict.fromkeys(variables)
    for table, requests, _ in tables:
        channels.update(dict.fromkeys(table.channel(ps) for ps in requests))
    await asyncio.gather(*(fences_first(ch) for ch in channels))
    staging: list[Any] = [
        ch.request(RestoreCheckpoint(vars=specs, stage=stage)) for ch, specs in variables.items()
    ]
    for table, requests, _ in tables:
        staging += [table.channel(ps).request(req) for ps, req in requests.items()]
    staged = await asyncio.gather(*staging, return_exceptions=True)
    failed = [r for r in staged if isinstance(r, BaseException)]
    commits: dict[Channel, dict[str, int | None]] = {ch: {} for ch in channels}
    if not failed:
        replies = iter(staged[len(variables) :])
        try:
            for table, requests, shares in tables:
                rows = {ps: int(getattr(next(replies), "staged", 0) or 0) for ps in requests}
                for ps, share in share_capacity(table.capacity, shares, rows, table.key).items():
                    commits[table.channel(ps)][table.key] = share
        except InvalidArgumentError as exc:
            failed.append(exc)
    if failed:
        await asyncio.gather(
            *(ch.request(AbortRestore(stage=stage)) for ch in channels), return_exceptions=True
        )
        raise failed[0]
    done = await asyncio.gather(
        *(ch.request(CommitRestore(stage=stage, tables=commits[ch])) for ch in channels)
    )
    return dict(zip(channels, done))
