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
