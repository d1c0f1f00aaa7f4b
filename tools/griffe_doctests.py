"""A griffe extension for the API reference: the doctest runs in docstrings (``>>>`` lines and
their output, up to a blank line) become ``pycon`` code blocks, as they are code."""

from __future__ import annotations

from typing import Any

import griffe


class DoctestFences(griffe.Extension):
    def on_instance(self, **kwargs: Any) -> None:
        obj = kwargs.get("obj")
        docstring = getattr(obj, "docstring", None)
        if docstring is None or ">>>" not in docstring.value:
            return
        out: list[str] = []
        inside = False
        for line in docstring.value.split("\n"):
            if not inside and line.lstrip().startswith(">>>"):
                out.append("```pycon")
                inside = True
            elif inside and not line.strip():
                out.append("```")
                inside = False
            out.append(line)
        if inside:
            out.append("```")
        docstring.value = "\n".join(out)


class HideInternal(griffe.Extension):
    """Members marked ``@internal`` (``pstrain._base.exports.internal``: public names that
    pstrain's own layers call, not a program) are left out of the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: set[str] = set()

    def _mark(self, node: Any, obj: Any) -> None:
        for decorator in getattr(node, "decorator_list", None) or []:
            name = getattr(decorator, "id", None) or getattr(decorator, "attr", None)
            if name == "internal":
                self.hidden.add(obj.path)

    def on_function_instance(self, *, node: Any, func: Any, **kwargs: Any) -> None:
        self._mark(node, func)

    def on_attribute_instance(self, *, node: Any, attr: Any, **kwargs: Any) -> None:
        self._mark(node, attr)  # a property: its getter's decorators

    def on_package(self, *, pkg: Any, **kwargs: Any) -> None:
        self._prune(pkg, set())

    def _prune(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen or getattr(obj, "is_alias", False):
            return
        seen.add(id(obj))
        for name, member in list(obj.members.items()):
            if getattr(member, "is_alias", False):
                continue
            if member.path in self.hidden:
                del obj.members[name]
            elif getattr(member, "is_class", False) or getattr(member, "is_module", False):
                self._prune(member, seen)
