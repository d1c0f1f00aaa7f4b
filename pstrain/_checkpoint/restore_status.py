"""What a checkpoint restore matched, and the restores it still owes (deferred restoration).

``Checkpoint.restore`` returns a :class:`CheckpointLoadStatus`. It restores
what exists now all or nothing across the ps (each ps stages its values, then
all commit), keeps TF's assertions about what matched, and stays live: a
variable attached later to a restored Module (or to the checkpoint) at a saved
path, and optimizer slots of such variables, are restored when they appear:
queued with their placement's next creations (``placement.queue_restore``), or
written at once for local variables.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._formats.files.checkpoint_files import CheckpointReader
from .._formats.files.tensor_files import read_rows
from .._formats.messages.checkpoint_operations import RestoreSpec, RestoreTable
from .._formats.numerics.optimizer_rules import slot_shape
from .._training.module import Module, unwatch_attributes, watch_attributes
from .._variables.batched import ensure_created
from .._variables.placement import Placement
from .._variables.staged_restore import new_stage, restore_staged
from .._variables.variables import Variable
from .object_graph import Entry, Graph, join, slot_key, walk

if TYPE_CHECKING:
    from .._transport.channels import Channel

logger = logging.getLogger("pstrain.checkpoint")

__all__ = ["CheckpointLoadStatus", "targets"]


class _Tracker(Protocol):
    """The checkpoint a status belongs to."""

    def tracked_objects(self) -> dict[str, Any]: ...


@dataclass
class _Target:
    """One saved value to put back: its key, the variable it goes to (or whose optimizer slot
    it is), and the ps key of each part that receives it (in row order)."""

    key: str
    names: list[str]
    entry: Entry
    slot: bool = False
    #: the optimizer rule of a slot: its shape follows from its variable's (``slot_shape``)
    rule: str = ""

    def shape(self, of: tuple[int, ...]) -> tuple[int, ...]:
        """The shape this target has where its variable (or a part of it) has ``of``."""
        return slot_shape(self.rule, of) if self.slot else of


def targets(
    graph: Graph, saved: dict[str, Any], entries: dict[str, Entry], optimizers: dict[str, Any]
) -> list[_Target]:
    """The saved values for ``entries`` and for the slots ``optimizers`` keep of
    ``graph``'s variables (and ``graph``'s optimizers of ``entries``)."""
    out = [_Target(path, [p.key for p in e.parts], e) for path, e in entries.items() if path in saved]
    pairs = [(op, o, path, e) for op, o in graph.optimizers.items() for path, e in entries.items()]
    pairs += [
        (op, o, path, e)
        for op, o in optimizers.items()
        for path, e in graph.entries.items()
        if path not in entries
    ]
    for opt_path, opt, path, e in pairs:
        for slot in opt.slot_names():
            key = slot_key(path, opt_path, slot)
            if key in saved:
                out.append(
                    _Target(
                        key, [opt.slot_variable_name(p, slot) for p in e.parts], e, slot=True, rule=opt.kind
                    )
                )
    return out


def _check(path: str, target: _Target, meta: dict[str, Any]) -> None:
    e = target.entry
    shape = target.shape(e.shape)
    if tuple(meta["shape"]) != shape or np.dtype(meta["dtype"]) != e.dtype:
        raise InvalidArgumentError(
            f"checkpoint {path}: {target.key!r} was saved as {tuple(meta['shape'])} {meta['dtype']}, "
            f"the object at that path is {shape} {e.dtype} (variable {e.name!r})"
        )


class CheckpointLoadStatus:
    """What a restore matched, with TF's assertions. Returned by ``Checkpoint.restore``.

    Values are matched by path. The status stays live: variables attached later
    at saved paths, and slots created later, are restored and counted.
    """

    def __init__(self, checkpoint: _Tracker, reader: CheckpointReader | None, graph: Graph) -> None:
        self._checkpoint = checkpoint
        self._reader = reader
        self._saved: dict[str, Any] = reader.variables if reader is not None else {}
        self._graph = graph
        self._matched: set[str] = set()
        self._expect_partial = False
        self._watching: list[tuple[weakref.ref[Module], Callable[[str, Any], None]]] = []

    # -- TF's assertions -----------------------------------------------------------------------
    def _no_checkpoint(self) -> None:
        if self._reader is None:
            raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")

    def unmatched_values(self) -> list[str]:
        """Keys in the checkpoint that no object has taken (yet). An optimizer's step
        counter's mirror is not one: a job on one ps has none (it is the step again)."""
        return sorted(set(self._saved) - self._matched - _mirrors(self._graph))

    def objects_without_values(self) -> list[str]:
        """Paths of variables tracked by the checkpoint now that the checkpoint has no value
        for (a mirror of a step counter is not one: the restore sets it to the step)."""
        graph = walk(self._checkpoint.tracked_objects())
        mirrors = _mirrors(graph)
        return sorted(p for p in graph.entries if p not in self._saved and p not in mirrors)

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every value in the checkpoint was restored and every tracked object got one."""
        self._no_checkpoint()
        values, objects = self.unmatched_values(), self.objects_without_values()
        if values or objects:
            raise AssertionError(_describe(self._reader, values, objects))
        tracked = walk(self._checkpoint.tracked_objects())
        if not (tracked.entries or tracked.tables or tracked.optimizers):
            raise AssertionError(
                "the checkpoint tracks no variable, table or optimizer: nothing "
                "was restored (give Checkpoint the model whose variables live "
                "on the ps)"
            )
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every object tracked now got a value (values without objects are allowed)."""
        self._no_checkpoint()
        objects = self.objects_without_values()
        if objects:
            raise AssertionError(_describe(self._reader, [], objects))
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        """At least one value of the checkpoint was restored."""
        self._no_checkpoint()
        if not self._matched:
            raise AssertionError(
                f"nothing in checkpoint {self._reader.path if self._reader else None} "
                "matched the objects tracked (no common path)"
            )
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Silence the warning about checkpoint values that nothing took."""
        self._expect_partial = True
        return self

    def run_restore_ops(self, session: Any = None) -> None:
        """TF 1 graph mode's step; values are already restored here (no effect)."""

    def initialize_or_restore(self, session: Any = None) -> None:
        """TF 1 graph mode's step; values are already restored here (no effect)."""

    def __del__(self) -> None:
        try:
            left = self.unmatched_values()
            if left and not self._expect_partial and self._reader is not None:
                logger.warning(
                    "checkpoint %s: %d value(s) were never restored (no object at their "
                    "path): %s. Call expect_partial() on the restore status if that is "
                    "intended.",
                    self._reader.path,
                    len(left),
                    ", ".join(left[:10]),
                )
            for ref, callback in self._watching:
                module = ref()
                if module is not None:
                    unwatch_attributes(module, callback)
        except Exception:  # noqa: S110 - never raise from a finalizer (interpreter shutdown)
            pass

    # -- restoring ------------------------------------------------------------------------------
    def watch(self, modules: list[tuple[Module, str]]) -> None:
        """Restore what is attached later to these Modules at saved paths."""
        for module, path in modules:
            callback = self._attach_callback(path)
            watch_attributes(module, callback)
            self._watching.append((weakref.ref(module), callback))

    def _attach_callback(self, path: str) -> Callable[[str, Any], None]:
        me = weakref.ref(self)

        def attached(name: str, value: Any) -> None:
            status = me()
            if status is not None:
                status.attached(path, name, value)

        return attached

    def attached(self, prefix: str, name: str, value: Any) -> None:
        """``value`` was set as attribute ``name`` of the object at ``prefix``: restore what
        the checkpoint saved under that path (deferred restoration)."""
        if not any(
            k == join(prefix, name)
            or k.startswith(join(prefix, name) + "/")
            or f"/.OPTIMIZER_SLOT/{join(prefix, name)}/" in k
            for k in self._saved
        ):
            return
        sub = walk({name: value}, prefix)
        found = targets(self._graph, self._saved, sub.entries, sub.optimizers)
        self._graph.entries.update(sub.entries)
        self._graph.optimizers.update(sub.optimizers)
        self.watch(sub.modules)
        self.restore_deferred(found)

    def _pieces(
        self, targets: list[_Target]
    ) -> Iterator[tuple[Variable, list[list[list[Any]]], dict[str, Any] | None]]:
        """For each part receiving a target: the variable part (the slot's variable, for a
        slot), the checkpoint rows it takes, and the ``ckpt/restore`` entry for its ps
        (None for a local variable)."""
        assert self._reader is not None
        for target in targets:
            meta = self._saved[target.key]
            _check(self._reader.path, target, meta)
            e = target.entry
            for i, (name, part) in enumerate(zip(target.names, e.parts)):
                rows, patches = self._reader.rows_of(target.key, e.offsets[i], e.offsets[i + 1], not e.shape)
                if part.ps_index is None:
                    if target.slot:
                        raise InvalidArgumentError(
                            f"{target.key!r} is an optimizer slot of a local variable ({e.name!r}); "
                            "slots live on the ps, so the variable must be created in strategy.scope()"
                        )
                    yield part, [rows, patches], None
                    continue
                role = (
                    {"trainable": False, "slot_of": part.key}
                    if target.slot
                    else {"trainable": part.trainable}
                )
                yield (
                    part,
                    [rows, patches],
                    {
                        "name": name,
                        "dtype": e.dtype.str,
                        "shape": list(target.shape(part.shape)),
                        **role,
                        "sources": rows,
                        "patches": patches,
                    },
                )

    def restore_deferred(self, targets: list[_Target]) -> None:
        """Queue ``targets`` with their placements' next creations (variables not yet, or
        just, created) or write them at once (local variables)."""
        for part, rows, entry in self._pieces(targets):
            if entry is None:
                part.restore_local(read_rows(part.shape, part.dtype, *rows))
                continue
            placement, ps = part.creator, part.ps_index
            if not isinstance(placement, Placement) or ps is None:
                raise InvalidArgumentError(
                    f"cannot restore into {part.name!r}: the variable was not created by a strategy here"
                )
            placement.queue_restore(ps, entry, [part])
        self._matched.update(t.key for t in targets)
        for target in targets:
            logger.info("restored %s (deferred)", target.key)

    async def restore_now(
        self,
        targets: list[_Target],
        tables: Sequence[tuple[Any, dict[int, RestoreTable], dict[int, int | None]]] = (),
        stage: str | None = None,
    ) -> None:
        """Restore ``targets`` and ``tables`` (``staged_restore.restore_staged``'s, staged
        as ``stage``) all or nothing: every ps stages its values, then all commit."""
        await ensure_created(p for t in targets for p in t.entry.parts)
        by_ps: dict[Channel, list[RestoreSpec]] = {}
        local: list[tuple[Variable, np.ndarray]] = []
        for part, rows, entry in self._pieces(targets):
            if entry is None:
                local.append((part, read_rows(part.shape, part.dtype, *rows)))
            else:
                by_ps.setdefault(part.channel(), []).append(RestoreSpec(**entry))
        if by_ps or tables:
            replies = await restore_staged(by_ps, list(tables), stage or new_stage())
            for ch, reply in replies.items():
                if reply.incarnation is not None:
                    # a restarted ps, now restored: its coordinator's PsHealth knows it is handled
                    ch.session.restored.setdefault(ch.task, set()).add(reply.incarnation)
        for part, value in local:
            part.restore_local(value)
        self._matched.update(t.key for t in targets)


def _mirrors(graph: Graph) -> set[str]:
    """The paths of the tracked optimizers' step counter mirrors (``optimizers.py``)."""
    return {f"{path}/iterations_mirror" for path in graph.optimizers}


def _describe(reader: CheckpointReader | None, values: list[str], objects: list[str]) -> str:
    lines = [f"checkpoint {reader.path if reader else None} does not match the objects tracked:"]
    if values:
        lines.append(
            f"  {len(values)} value(s) in the checkpoint restored into nothing: " + ", ".join(values[:20])
        )
    if objects:
        lines.append(
            f"  {len(objects)} tracked object(s) with no value in the checkpoint: " + ", ".join(objects[:20])
        )
    return "\n".join(lines)


expose(globals(), "pstrain.checkpoint", ["CheckpointLoadStatus"])
