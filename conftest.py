"""Doctest collection: a public façade (``pstrain/errors.py`` over ``pstrain/_base/errors.py``)
only re-exports, so its classes' examples are collected, once, from the module that defines
them (``pstrain._base.exports.expose`` lists them in its ``__test__``)."""

from __future__ import annotations

from pathlib import Path

FACADE_DOC = '"""Public façade'


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    if collection_path.suffix == ".py" and collection_path.parent.name == "pstrain":
        with open(collection_path, encoding="utf-8") as f:
            if f.read(len(FACADE_DOC)) == FACADE_DOC:
                return True
    return None
