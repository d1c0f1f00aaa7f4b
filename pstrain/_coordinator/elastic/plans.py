"""What moves when a ps joins or leaves, planned without I/O: whole variables (and sharded
variables' parts), and slices of dynamic tables. ``moves.py`` carries the plans out.

Variables are balanced by bytes: a ps that joins takes the largest variables of the fullest
ps while that leaves it below the ps they came from; variables put back (a lost ps's share)
go, largest first, to the least loaded ps.

A dynamic table's ids are spread over the ps by a hash (``shard_of(id, num_ps)``). At its
first move, its hash space is cut into ``SLICES_PER_PS`` slices per ps it was created on
(``shard_of(id, slices)``; slice ``s`` starts on ps ``s % num_ps``, where its ids already
are), and the placement map lists the ps of each slice from then on. A ps that joins
takes slices from the ps holding the most until it holds its even share; a ps that
leaves gives each of its slices to the ps holding the fewest.

>>> from pstrain._formats.messages.placement_map import PlacementMap
>>> class Table: key, num_ps = "t", 2
>>> m = PlacementMap(version=1, ps=["h:1", "h:2", "h:3"])
>>> plan = plan_join(m, {"t": Table()}, 2)
>>> sorted(plan), sum(len(p["t"]) for p in plan.values()) == 2 * SLICES_PER_PS // 3
([0, 1], True)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..._formats.messages.placement_map import SLICES_PER_PS, PlacementMap, TableSlices, first_slices

__all__ = [
    "SLICES_PER_PS",
    "plan_join",
    "plan_leave",
    "plan_variables_join",
    "spread",
    "table_slices",
    "variable_shares",
    "variables_on",
]

#: A strategy's placed variables: key -> (the ps it was created on, its bytes).
Placed = dict[str, tuple[int, int]]


def variable_shares(placement: PlacementMap, placed: Placed) -> dict[int, int]:
    """Bytes of variables each active ps holds (their optimizer slots not counted)."""
    out = {k: 0 for k in placement.active()}
    for key, (home, nbytes) in placed.items():
        ps = placement.ps_of(key, home)
        out[ps] = out.get(ps, 0) + nbytes
    return out


def variables_on(placement: PlacementMap, placed: Placed, ps: int) -> list[str]:
    """The variables on ps ``ps``, largest first."""
    return sorted(
        (k for k, (home, _) in placed.items() if placement.ps_of(k, home) == ps), key=lambda k: -placed[k][1]
    )


def spread(
    placement: PlacementMap,
    placed: Placed,
    keys: list[str],
    to: int | None = None,
    leaving: Iterable[int] = (),
) -> dict[str, int]:
    """Where each of ``keys`` (largest first) goes: ps ``to``, or the least loaded (none of
    ``leaving``)."""
    out = set(leaving)
    active = [k for k in placement.active() if k not in out]
    shares = {k: n for k, n in variable_shares(placement, placed).items() if k in active}
    where = {}
    for key in keys:
        where[key] = target = to if to is not None else min(shares, key=lambda k: (shares[k], k))
        shares[target] += placed[key][1]
    return where


def plan_variables_join(placement: PlacementMap, placed: Placed, new: int) -> list[list[str]]:
    """Which variables move to the new ps ``new``: the largest of the fullest ps, while
    that leaves the new one below the ps it came from."""
    shares = variable_shares(placement, placed)
    plan: list[list[str]] = []
    candidates = {k: variables_on(placement, placed, k) for k in shares if k != new}
    while True:
        fullest = max(candidates, key=lambda k: shares[k], default=None)
        if fullest is None or not candidates[fullest]:
            return plan
        key = next((k for k in candidates[fullest] if shares[new] + placed[k][1] < shares[fullest]), None)
        if key is None:
            return plan
        candidates[fullest].remove(key)
        shares[fullest] -= placed[key][1]
        shares[new] += placed[key][1]
        plan.append([key])


def table_slices(placement: PlacementMap, table: Any) -> TableSlices:
    """Which ps holds each slice of ``table`` now (before its first move: where it was
    created, ``first_slices``)."""
    sliced = placement.tables.get(table.key)
    if sliced is not None:
        return sliced
    return getattr(table, "birth", None) or first_slices(table.num_ps)


def plan_join(placement: PlacementMap, tables: dict[str, Any], new: int) -> dict[int, dict[str, list[int]]]:
    """Slices for ps ``new`` (just joined): from the ps holding the most of each table, one
    at a time, until it holds its even share. source -> table -> slices."""
    plan: dict[int, dict[str, list[int]]] = {}
    holders = len(placement.active())
    for key, table in tables.items():
        owners = list(table_slices(placement, table).owners)
        held = {ps: [s for s, o in enumerate(owners) if o == ps] for ps in set(owners)}
        held.setdefault(new, [])
        while len(held[new]) < len(owners) // holders:
            src = max((ps for ps in held if ps != new), key=lambda ps: (len(held[ps]), -ps))
            held[new].append(held[src].pop())
            plan.setdefault(src, {}).setdefault(key, []).append(held[new][-1])
    return plan


def plan_leave(
    placement: PlacementMap, tables: dict[str, Any], gone: int, leaving: Iterable[int] = ()
) -> dict[int, dict[str, list[int]]]:
    """Where each slice ps ``gone`` holds goes: to the ps holding the fewest of that table
    among the others (none of ``leaving``). destination -> table -> slices."""
    plan: dict[int, dict[str, list[int]]] = {}
    out = {gone, *leaving}
    others = [k for k in placement.active() if k not in out]
    for key, table in tables.items():
        owners = table_slices(placement, table).owners
        count = {k: sum(1 for o in owners if o == k) for k in others}
        for s, owner in enumerate(owners):
            if owner == gone:
                dst = min(others, key=lambda k: (count[k], k))
                count[dst] += 1
                plan.setdefault(dst, {}).setdefault(key, []).append(s)
    return plan
