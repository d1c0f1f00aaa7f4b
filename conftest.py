"""Doctest collection: a public façade (``pstrain/errors.py`` over ``pstrain/_base/errors.py``)
only re-exports, so its classes' examples are collected, once, from the module that defines
them (``pstrain._base.exports.expose`` lists them in its ``__test__``). A façade is a module
of ``pstrain/`` whose body is imports and its ``__all__`` (``tests/unit/test_architecture.py``
lists them and holds them to that)."""

from __future__ import annotations

import ast
from pathlib import Path


def _is_facade(path: Path) -> bool:
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return bool(body) and all(
        isinstance(node, ast.ImportFrom)
        or (
            isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            and all(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
        )
        for node in body
    )


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    if (
        collection_path.suffix == ".py"
        and collection_path.parent.name == "pstrain"
        and _is_facade(collection_path)
    ):
        return True
    return None
