"""The object graph a checkpoint saves: every variable keyed by its path from the root.

Like TF's trackable object graph, a variable's key is the path of attribute
names (and list indices, dict keys) that leads to it from the objects given
to ``Checkpoint(...)``: ``model/dense/kernel``. Names given to variables, and
the process-wide counters that generate them, play no part, so the same code
restores the same state however many other variables exist.

* a :class:`~pstrain._variables.sharding.ShardedVariable` is one entry (its parts are
  the row ranges of that entry);
* an optimizer contributes ``<optimizer path>/iterations`` and, for every
  tracked variable, its slots under TF's key
  ``<variable path>/.OPTIMIZER_SLOT/<optimizer path>/<slot>``;
* a :class:`~pstrain.DynamicEmbedding` is one table entry (ids, rows and the
  slots of every optimizer, one file per ps);
* Modules, metrics and plain objects (an equinox module of pstrain variables,
  say) are walked through their attributes, dicts through their keys, lists
  and tuples through their indices; breadth first, so a variable reachable
  twice is keyed by its shortest path.
* A framework model whose parameters live on the ps (a ``torch.nn.Module``
  wrapped by ``pstrain.torch.RemoteModule``) has a *view*
  (:func:`register_view`): its parameters by their own path in the model,
  ``model/tower/0/weight``, never by position; the module and its
  RemoteModule give the same keys.

Names inside a path are escaped as TF does (``.`` → ``..``, ``/`` → ``.S``),
so an attribute called ``a/b`` can never be confused with ``a`` → ``b``.

>>> import pstrain
>>> class Dense(pstrain.Module):
...     def __init__(self):
...         super().__init__()
...         self.kernel = pstrain.Variable([[1.0]], name="w")
>>> sorted(walk({"model": {"dense": Dense()}}).entries)
['model/dense/kernel']
"""

from __future__ import annotations

import types
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._training.module import Module
from .._training.optimizers import Optimizer
from .._variables.dynamic import DynamicEmbedding
from .._variables.sharding import ShardedVariable
from .._variables.variables import Variable

__all__ = [
    "Entry",
    "Graph",
    "check_trackable",
    "escape",
    "join",
    "register_view",
    "slot_key",
    "table_slots",
    "walk",
]

SLOT_MARK = ".OPTIMIZER_SLOT"

_SKIP = (
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    type,
    np.ndarray,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
)
#: Runtime objects a model may hold a reference to but whose state is not the model's: the
#: packages of the runtime, and classes that say so (public ones report ``pstrain`` as their
#: module, like the model's own classes, so the module alone cannot tell).
_OPAQUE_MODULES = (
    "pstrain._distribute.",
    "pstrain._coordinator.",
    "pstrain._transport.",
    "pstrain._variables.placement",
    "pstrain.launch",
    "pstrain.testing",
    "asyncio",
    "logging",
    "threading",
)
OPAQUE_MARK = "__pstrain_opaque__"


#: object -> its checkpoint children by path components (see :func:`register_view`). Weak
#: keys: a view holds the variables, never the object, so it goes with the object.
_VIEWS: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], Any]] = weakref.WeakKeyDictionary()


def register_view(obj: Any, children: Mapping[tuple[str, ...], Any]) -> None:
    """A checkpoint reaches ``children`` (path components -> variable or table) through
    ``obj`` instead of its attributes: how a framework model (an ``nn.Module``) whose
    parameters live on the ps is keyed by its own parameter paths."""
    _VIEWS[obj] = dict(children)


def registered_view(obj: Any) -> dict[tuple[str, ...], Any] | None:
    """The children :func:`register_view` gave ``obj``, or None."""
    return _view(obj)


def _view(obj: Any) -> dict[tuple[str, ...], Any] | None:
    try:
        return _VIEWS.get(obj)
    except TypeError:  # neither hashable nor weakly referable: it has no view
        return None


def _is_torch_module(obj: Any) -> bool:
    return any(
        c.__name__ == "Module" and c.__module__ == "torch.nn.modules.module" for c in type(obj).__mro__
    )


def _is_foreign_array(obj: Any) -> bool:
    """A framework's tensor (jax, torch): state of this process, not of the ps."""
    module = type(obj).__module__
    return module.startswith(("jax", "jaxlib", "torch")) and hasattr(obj, "shape")


def check_trackable(name: str, obj: Any) -> None:
    """Refuse, with what to do instead, an object a checkpoint could save nothing of.

    Containers and pstrain Modules are accepted empty (variables attached later are
    tracked then); any other object must hold at least one pstrain variable, table or
    optimizer. ``InvalidArgumentError`` names the object and the fix."""
    if (
        isinstance(obj, (Variable, ShardedVariable, DynamicEmbedding, Optimizer, Module, dict, list, tuple))
        or _view(obj) is not None
    ):
        return
    graph = walk({name: obj})
    # (a torch model's own parameters are not saved unless a RemoteModule put them on the ps,
    # even when it holds tables that are: refused rather than saved in part)
    local = _is_torch_module(obj) and any(True for _ in obj.parameters())
    if (graph.entries or graph.tables or graph.optimizers) and not local:
        return
    if _is_torch_module(obj):
        fix = (
            "its parameters are torch tensors of this process: create "
            "pstrain.torch.RemoteModule(model) in strategy.scope() first (the checkpoint then "
            "saves the ps variables, keyed by parameter path)"
        )
    elif _is_foreign_array(obj) or hasattr(obj, "__jax_array__"):
        fix = (
            "it is an array of this process: put the model on the ps with "
            "pstrain.jax.variables_from(model) in strategy.scope() and checkpoint that"
        )
    else:
        fix = (
            "a checkpoint tracks pstrain variables, tables, optimizers and Modules, and "
            "objects or containers that hold them"
        )
    raise InvalidArgumentError(
        f"Checkpoint({name}=...) cannot track a {type(obj).__module__}.{type(obj).__qualname__}: {fix}"
    )


def escape(name: str) -> str:
    """One path component, escaped as TF does.

    >>> escape("a/b.c")
    'a.Sb..c'
    """
    return name.replace(".", "..").replace("/", ".S")


def join(prefix: str, name: str) -> str:
    return f"{prefix}/{escape(name)}" if prefix else escape(name)


def slot_key(variable_path: str, optimizer_path: str, slot: str) -> str:
    """TF's key of ``slot`` of the variable at ``variable_path`` in the optimizer's state."""
    return f"{variable_path}/{SLOT_MARK}/{optimizer_path}/{escape(slot)}"


@dataclass
class Entry:
    """One logical variable: its parts (in row order) and their row offsets."""

    path: str
    name: str
    parts: list[Variable]
    offsets: list[int]
    shape: tuple[int, ...]
    dtype: np.dtype
    trainable: bool

    @classmethod
    def of(cls, path: str, v: Variable | ShardedVariable) -> Entry:
        if isinstance(v, ShardedVariable):
            return cls(path, v.name, v.variables, [int(o) for o in v.offsets], v.shape, v.dtype, v.trainable)
        rows = v.shape[0] if v.shape else 1
        return cls(path, v.name, [v], [0, rows], v.shape, v.dtype, v.trainable)


@dataclass
class Graph:
    """What a walk found: variables and optimizers by path, and the Modules on the way."""

    entries: dict[str, Entry] = field(default_factory=dict)
    optimizers: dict[str, Optimizer] = field(default_factory=dict)
    tables: dict[str, DynamicEmbedding] = field(default_factory=dict)
    modules: list[tuple[Module, str]] = field(default_factory=list)

    def merge(self, other: Graph) -> None:
        for path, entry in other.entries.items():
            self.entries.setdefault(path, entry)
        for path, opt in other.optimizers.items():
            self.optimizers.setdefault(path, opt)
        for path, table in other.tables.items():
            self.tables.setdefault(path, table)
        self.modules.extend(other.modules)


def _children(obj: Any) -> list[tuple[str, Any]]:
    if _is_torch_module(obj):  # only its submodules (one may be wrapped by a RemoteModule)
        return list(getattr(obj, "_modules", {}).items())
    if isinstance(obj, dict):
        return [(str(k), v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(obj)]
    if isinstance(obj, Module):
        return [(k, v) for k, v in vars(obj).items() if not k.startswith("_module_")]
    cls = type(obj)
    if hasattr(obj, "__dict__") and not (
        getattr(cls, OPAQUE_MARK, False) or cls.__module__.startswith(_OPAQUE_MODULES)
    ):
        return list(vars(obj).items())
    return []


def walk(roots: dict[str, Any], prefix: str = "", seen: set[int] | None = None) -> Graph:
    """Every variable, optimizer and Module reachable from ``roots``, by path (breadth first)."""
    graph = Graph()
    seen = set() if seen is None else seen
    todo: deque[tuple[str, Any]] = deque((join(prefix, k), v) for k, v in roots.items())
    while todo:
        path, obj = todo.popleft()
        if obj is None or isinstance(obj, _SKIP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        view = _view(obj)
        if view is not None:
            for parts, child in view.items():
                todo.append(("/".join([path, *map(escape, parts)]), child))
        elif isinstance(obj, (Variable, ShardedVariable)):
            graph.entries[path] = Entry.of(path, obj)
        elif isinstance(obj, DynamicEmbedding):
            graph.tables[path] = obj
        elif isinstance(obj, Optimizer):
            graph.optimizers[path] = obj
            todo.append((join(path, "iterations"), obj.iterations))
            if obj.iterations_mirror is not None:
                todo.append((join(path, "iterations_mirror"), obj.iterations_mirror))
        else:
            if isinstance(obj, Module):
                graph.modules.append((obj, path))
            todo.extend((join(path, k), v) for k, v in _children(obj))
    return graph


def table_slots(graph: Graph) -> dict[str, str]:
    """Each tracked optimizer's table slot key on the ps (``<name>/<slot>``) -> its key in a
    checkpoint (``<optimizer path>/<slot>``): stable across programs, as the variables'."""
    return {
        f"{opt.name}/{slot}": f"{path}/{slot}"
        for path, opt in graph.optimizers.items()
        for slot in opt.slot_names()
    }
