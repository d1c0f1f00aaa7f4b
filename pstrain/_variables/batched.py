"""Many variables at once: read or updated with one request per ps (``pstrain.read_variables``,
``pstrain.update_variables``), and :func:`ensure_created`, the one awaitable that
guarantees variables exist on their ps before requests of one's own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.context import must_await
from .._base.errors import InvalidArgumentError
from .._formats.messages.operations import ReadVariables, Update, UpdateKind, UpdateVariables
from .arrays import VariableBase, VariableCreator
from .routing import routed
from .variables import Variable

if TYPE_CHECKING:
    from .._transport.channels import Channel

__all__ = ["ensure_created", "read_variables", "update_variables"]


async def ensure_created(variables: Iterable[Any]) -> None:
    """Wait until every one of ``variables`` (sharded ones included) exists on its ps.

    Every operation of a variable does this itself; call it before sending
    requests of your own (``channel().call``) for variables just created.
    """
    creators: dict[int, VariableCreator] = {}
    for v in variables:
        for part in getattr(v, "variables", None) or [v]:
            creator = getattr(part, "creator", None)
            if creator is not None and not part.is_created():
                creators[id(creator)] = creator
    for creator in creators.values():
        await creator.ensure_created()


@must_await
async def read_variables(variables: Iterable[Any]) -> list[np.ndarray]:
    """Read many variables with one request per ps, concurrently.

    >>> import asyncio
    >>> w, b = Variable([1.0, 2.0]), Variable(3)       # local variables: no cluster needed
    >>> [a.tolist() for a in asyncio.run(read_variables([w, b]))]
    [[1.0, 2.0], 3]
    """
    variables = list(variables)
    for v in variables:
        if not isinstance(v, VariableBase):
            raise InvalidArgumentError(f"read_variables takes variables, got {type(v).__name__}")
    # a ShardedVariable's parts go in the same requests as the other variables of their ps
    spans: list[tuple[int, int]] = []
    parts: list[Variable] = []
    for v in variables:
        pieces = [v] if isinstance(v, Variable) else list(v.variables)
        spans.append((len(parts), len(parts) + len(pieces)))
        parts.extend(pieces)
    got: list[Any] = [None] * len(parts)
    placed: list[int] = []
    for i, part in enumerate(parts):
        if part.ps_index is None:
            got[i] = part.local_array().copy()
        else:
            placed.append(i)
    await ensure_created(parts[i] for i in placed)

    async def read_group(channel: Channel, indices: list[int]) -> None:
        names = list(dict.fromkeys(parts[i].key for i in indices))  # each read once
        reply = await channel.request(ReadVariables(names=names))
        values = dict(zip(names, reply.values))
        for i in indices:
            got[i] = values[parts[i].key]

    def channel_of(i: int) -> Channel:
        return parts[i].channel()

    if placed:
        await routed(parts[placed[0]].channels(), placed, channel_of, read_group)
    return [
        got[a] if isinstance(v, Variable) else np.concatenate(got[a:b], axis=0)
        for v, (a, b) in zip(variables, spans)
    ]


@must_await
async def update_variables(updates: Iterable[tuple[Variable, str, Any]]) -> None:
    """Apply ``(variable, op, value)`` updates with one request per ps, all or nothing per ps.

    ``op`` is ``assign``, ``assign_add`` or ``assign_sub``.

    >>> import asyncio
    >>> total, count = Variable(0.0), Variable(0.0)
    >>> asyncio.run(update_variables([(total, "assign_add", 3.0), (count, "assign_add", 1.0)]))
    >>> float(asyncio.run(total.numpy())), float(asyncio.run(count.numpy()))
    (3.0, 1.0)
    """
    entries: list[tuple[Variable, Update]] = []
    local = []
    placed = []
    for var, op, value in updates:
        if op not in ("assign", "assign_add", "assign_sub"):
            raise InvalidArgumentError(f"update_variables: unknown op {op!r}")
        if not isinstance(var, Variable):
            raise InvalidArgumentError(f"update_variables takes Variables, got {type(var).__name__}")
        arr = var.checked_value(value, op)
        if var.ps_index is None:
            local.append((var, op, arr))
            continue
        placed.append(var)
        entries.append((var, Update(op=UpdateKind(op), name=var.key, value=arr)))
    for var, op, arr in local:
        await getattr(var, op)(arr)
    if not entries:
        return
    await ensure_created(placed)

    async def send(channel: Channel, group: list[tuple[Variable, Update]]) -> None:
        await channel.request(UpdateVariables(updates=[u for _, u in group]))

    await routed(placed[0].channels(), entries, lambda e: e[0].channel(), send)
