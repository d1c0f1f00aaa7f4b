"""Module: a container whose ``variables`` are those of its attributes.

Like ``tf.Module``: assign variables (or other modules, or lists, tuples and
dicts of them) to attributes, and ``variables`` / ``trainable_variables``
collect them, depth first in attribute order, each once. A sharded variable
contributes its parts.

>>> import pstrain
>>> class Dense(pstrain.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = pstrain.Variable([[1.0]], name="w")
...         self.b = pstrain.Variable([0.0], name="b", trainable=False)
>>> [v.name for v in Dense().trainable_variables]
['w']
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .._base.exports import expose
from .._variables.arrays import VariableBase
from .._variables.sharding import ShardedVariable

__all__ = ["Module", "unwatch_attributes", "watch_attributes"]

#: Callbacks ``(name, value)`` run after an attribute of a watched Module is set, by id.
_watchers: dict[int, list[Callable[[str, Any], None]]] = {}


def watch_attributes(module: Module, callback: Callable[[str, Any], None]) -> None:
    """Call ``callback(name, value)`` after every attribute assignment on ``module``.

    A checkpoint restore uses it to restore variables attached after ``restore()``
    (deferred restoration, as TF's trackables do). Held until ``module`` is collected.
    """
    key = id(module)
    if key not in _watchers:
        weakref.finalize(module, _watchers.pop, key, None)
    _watchers.setdefault(key, []).append(callback)


def unwatch_attributes(module: Module, callback: Callable[[str, Any], None]) -> None:
    """Stop calling ``callback`` for ``module`` (no error if it was not watching)."""
    callbacks = _watchers.get(id(module), [])
    if callback in callbacks:
        callbacks.remove(callback)


class Module:
    """Base class for models and layers that own variables."""

    def __init__(self, name: str | None = None) -> None:
        self._module_name = name or type(self).__name__

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        callbacks = _watchers.get(id(self))
        if callbacks:
            for callback in list(callbacks):
                callback(name, value)

    @property
    def name(self) -> str:
        """The module's name: its class name unless one was given."""
        return getattr(self, "_module_name", type(self).__name__)

    @property
    def variables(self) -> tuple[Any, ...]:
        """Every variable reachable from this module's attributes (parts of sharded ones)."""
        out: list[Any] = []
        _collect(self, out, set(), set())
        return tuple(out)

    @property
    def trainable_variables(self) -> tuple[Any, ...]:
        """The trainable variables of this module and its submodules (a sharded variable as its parts, as TF
        lists them)."""
        return tuple(v for v in self.variables if v.trainable)

    @property
    def submodules(self) -> tuple[Module, ...]:
        """Every module reachable from this one's attributes (and the lists, tuples and dicts among them),
        depth first, each once."""
        out: list[Module] = []
        _submodules(self, out, {id(self)})
        return tuple(out)


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, Module):
        return [v for k, v in vars(obj).items() if not k.startswith("_module_")]
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return []


def _collect(obj: Any, out: list[Any], seen_vars: set[int], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, VariableBase):
        for v in obj.variables if isinstance(obj, ShardedVariable) else [obj]:
            if id(v) not in seen_vars:
                seen_vars.add(id(v))
                out.append(v)
        return
    for child in _children(obj):
        _collect(child, out, seen_vars, seen)


def _submodules(obj: Any, out: list[Module], seen: set[int]) -> None:
    for child in _children(obj):
        if id(child) in seen:
            continue
        seen.add(id(child))
        if isinstance(child, Module):
            out.append(child)
        if isinstance(child, (Module, dict, list, tuple)):
            _submodules(child, out, seen)


expose(globals(), "pstrain", ["Module"])
