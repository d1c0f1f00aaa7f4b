"""Public classes report the public module users import them from, not the private one that
defines them (``pstrain.errors.NotFoundError``, ``pstrain.ClusterCoordinator``): in reprs,
tracebacks, pickles and the docs."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = ["expose", "internal"]

_F = TypeVar("_F")


def expose(namespace: dict[str, Any], module: str, names: Iterable[str] | None = None) -> None:
    """Set ``__module__`` to ``module`` on the classes among ``names`` (by default the
    namespace's ``__all__``) that the namespace defines.

    Doctest finds a class's examples only in the module its ``__module__`` names, and runs
    them with that module's globals: they stay with the module that defines them, listed in
    its ``__test__`` (the façades are not searched for doctests: see ``conftest.py``).
    """
    here = namespace["__name__"]
    tests: dict[str, Any] = namespace.setdefault("__test__", {})
    for name in namespace["__all__"] if names is None else names:
        obj = namespace[name]
        if not inspect.isclass(obj) or obj.__module__ != here:
            continue
        obj.__module__ = module
        tests[name] = obj


def internal(member: _F) -> _F:
    """Mark a public-named member of a public class as pstrain's own (its layers call it
    across modules; a program should not): the API reference leaves it out (the griffe
    extension in ``tools/griffe_doctests.py`` drops what carries it). Nothing at run time."""
    return member
