"""Where a collection's tables live: small tables whole, large ones row-sharded over every ps,
the whole ones placed so that each ps holds about as many bytes and serves about as many
lookups as the others.

A table of more rows than ``shard_rows`` (default 100,000, W8's rule) is cut by rows into
one part per ps (TF's "div" layout): its bytes and lookups spread evenly. The other tables,
heaviest first, each go to the ps whose load is then the smallest, the load of a ps being
its share of all the bytes plus its share of all the expected lookups (a table's expected
lookups per example: the sum of its features' ``pooling_factor``). A dynamic table (no
fixed rows) is spread by id hash over every ps, as any dynamic table.

>>> from pstrain import TableConfig
>>> plan = plan_tables([TableConfig("big", 1_000_000, 16, ["a"]),
...                     TableConfig("small", 1_000, 16, ["b"]),
...                     TableConfig("tiny", 10, 16, ["c"], pooling_factor=20)], num_ps=2)
>>> [(t.name, t.kind, t.ps) for t in plan.tables]
[('big', 'row-sharded', [0, 1]), ('small', 'whole', [1]), ('tiny', 'whole', [0])]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .._base.errors import InvalidArgumentError

if TYPE_CHECKING:
    from .config import TableConfig

__all__ = ["DEFAULT_SHARD_ROWS", "PlacedTable", "TablePlan", "plan_tables"]

#: Tables with more rows than this are row-sharded over every ps (W8's rule).
DEFAULT_SHARD_ROWS = 100_000


@dataclass
class PlacedTable:
    """One table's place: ``kind`` is ``"whole"`` (on ``ps[0]``), ``"row-sharded"`` (part
    ``i`` on ``ps[i]``) or ``"dynamic"`` (by id hash over every ps)."""

    name: str
    kind: str
    ps: list[int]
    nbytes: int
    lookups: float


@dataclass
class TablePlan:
    """The planner's answer: each table's place, and what each ps then holds and serves."""

    tables: list[PlacedTable]
    num_ps: int
    bytes_per_ps: list[float] = field(default_factory=list)
    lookups_per_ps: list[float] = field(default_factory=list)

    def __getitem__(self, name: str) -> PlacedTable:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def __str__(self) -> str:
        lines = [f"{'table':<24} {'kind':<12} {'ps':<10} {'MB':>9} {'lookups/ex':>10}"]
        for t in self.tables:
            where = ",".join(map(str, t.ps)) if len(t.ps) < 5 else f"0-{self.num_ps - 1}"
            lines.append(f"{t.name:<24} {t.kind:<12} {where:<10} {t.nbytes / 1e6:>9.2f} {t.lookups:>10.2f}")
        for k in range(self.num_ps):
            lines.append(
                f"ps {k}: {self.bytes_per_ps[k] / 1e6:.2f} MB, "
                f"{self.lookups_per_ps[k]:.2f} lookups per example"
            )
        return "\n".join(lines)


def plan_tables(
    configs: Sequence[TableConfig], num_ps: int, shard_rows: int = DEFAULT_SHARD_ROWS, slots: int = 0
) -> TablePlan:
    """Place ``configs`` on ``num_ps`` ps (see the module's docstring). ``slots``: optimizer
    slots per row as wide as the row (an Adagrad accumulator: 1), counted in the bytes."""
    if num_ps < 1:
        raise InvalidArgumentError(f"plan_tables: num_ps must be at least 1, got {num_ps}")
    if shard_rows < 1:
        raise InvalidArgumentError(f"shard_rows must be a positive number of rows, got {shard_rows}")
    bytes_at = np.zeros(num_ps)
    lookups_at = np.zeros(num_ps)
    placed: dict[str, PlacedTable] = {}
    whole: list[tuple[TableConfig, int, float]] = []
    for c in configs:
        lookups = float(c.pooling_factor) * len(c.feature_names)
        if c.num_embeddings is None:
            nbytes = 0
            placed[c.name] = PlacedTable(c.name, "dynamic", list(range(num_ps)), nbytes, lookups)
            lookups_at += lookups / num_ps
            continue
        nbytes = c.num_embeddings * c.embedding_dim * np.dtype(c.dtype).itemsize * (1 + slots)
        if c.num_embeddings > shard_rows and num_ps > 1:
            placed[c.name] = PlacedTable(c.name, "row-sharded", list(range(num_ps)), nbytes, lookups)
            bytes_at += nbytes / num_ps
            lookups_at += lookups / num_ps
        else:
            whole.append((c, nbytes, lookups))
    total_bytes = float(sum(t.nbytes for t in placed.values()) + sum(b for _, b, _ in whole)) or 1.0
    total_lookups = float(sum(t.lookups for t in placed.values()) + sum(x for _, _, x in whole)) or 1.0

    def load(b: np.ndarray | float, x: np.ndarray | float) -> np.ndarray | float:
        return b / total_bytes + x / total_lookups

    for c, nbytes, lookups in sorted(whole, key=lambda t: -float(load(t[1], t[2]))):
        k = int(np.argmin(load(bytes_at + nbytes, lookups_at + lookups)))
        placed[c.name] = PlacedTable(c.name, "whole", [k], nbytes, lookups)
        bytes_at[k] += nbytes
        lookups_at[k] += lookups
    return TablePlan([placed[c.name] for c in configs], num_ps, bytes_at.tolist(), lookups_at.tolist())
