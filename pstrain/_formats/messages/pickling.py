"""Pickling closures so that workers can load them.

cloudpickle sends a function from an importable module *by reference* (module
and name), which fails on a worker that cannot import that module: a user's
``train.py`` importing ``model.py`` from its own folder, say. User modules
(anything outside the interpreter's standard library and site-packages) are
therefore registered to travel *by value*, along with the user modules the
function's code refers to.

A pstrain class reports its public module (``pstrain.errors.NotFoundError``). cloudpickle
looks a class up only in the modules already imported, and would send it by value when
that public module (a façade) is not imported yet in this process; the standard pickle
imports it, and so does :func:`dumps_object`, which every pickle pstrain sends goes through.
"""

from __future__ import annotations

import builtins
import importlib
import io
import os
import pickle
import site
import sys
import sysconfig
import types
from functools import lru_cache
from typing import Any

import cloudpickle
import cloudpickle.cloudpickle

from ..._base.errors import ImportNeeded

_registered: set[str] = set()


@lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(os.path.realpath(path))
    for path in [*getattr(site, "getsitepackages", lambda: [])(), site.getusersitepackages()]:
        dirs.add(os.path.realpath(path))
    return tuple(sorted(dirs))


def _is_user_module(module: types.ModuleType) -> bool:
    name = module.__name__
    if name == "__main__" or name == "pstrain" or name.startswith("pstrain."):
        return False  # __main__ is pickled by value anyway; pstrain is on every worker
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = os.path.realpath(file)
    return not any(path.startswith(d + os.sep) for d in _library_dirs())


def _register(module_name: str | None) -> None:
    if not module_name or module_name in _registered:
        return
    _registered.add(module_name)
    top = sys.modules.get(module_name.split(".")[0])
    module = sys.modules.get(module_name)
    if module is None or top is None or not _is_user_module(module):
        return
    try:
        cloudpickle.register_pickle_by_value(top)
    except (ValueError, TypeError):
        pass  # not a module cloudpickle can send by value; stays by reference


def dumps(fn: Any) -> bytes:
    """cloudpickle ``fn``, sending user modules it depends on by value."""
    send_modules_by_value(fn)
    return dumps_object(fn)


def send_modules_by_value(fn: Any) -> None:
    """Have the user modules ``fn`` comes from or names (outside site-packages and the
    standard library) pickled by value from now on: a worker need not have them. Names are
    the globals its code uses and the variables it closes over."""
    _register(getattr(fn, "__module__", None))
    code = getattr(fn, "__code__", None)
    glb = getattr(fn, "__globals__", None)
    named: list[Any] = []
    if code is not None and glb is not None:
        named += [glb.get(name) for name in code.co_names]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            named.append(cell.cell_contents)
        except ValueError:  # a cell not filled yet
            pass
    for obj in named:
        if isinstance(obj, types.ModuleType):
            _register(obj.__name__)
        elif obj is not None:
            _register(getattr(obj, "__module__", None))


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type):
            module = obj.__module__
            if module.startswith("pstrain.") and module not in sys.modules:
                importlib.import_module(module)  # as the standard pickle does
        return super().reducer_override(obj)


def dumps_object(obj: Any) -> bytes:
    """cloudpickle ``obj`` (protocol 5), finding pstrain classes under their public module."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


def _imported_only(importer: Any) -> Any:
    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in sys.modules:
            raise ImportNeeded(name)
        return importer(name, *args, **kwargs)

    return call


#: What a pickle may call to import a module (cloudpickle names a function's modules so).
_IMPORTERS = {
    ("cloudpickle.cloudpickle", "subimport"): cloudpickle.cloudpickle.subimport,
    ("builtins", "__import__"): builtins.__import__,
    ("importlib", "import_module"): importlib.import_module,
}


class _ImportedOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module not in sys.modules:
            raise ImportNeeded(module)
        importer = _IMPORTERS.get((module, name))
        if importer is not None:
            return _imported_only(importer)
        return super().find_class(module, name)


def loads_imported(data: bytes) -> Any:
    """``cloudpickle.loads``, if that imports no module this process has not imported yet; raises
    :class:`~pstrain._base.errors.ImportNeeded` before importing one."""
    return _ImportedOnly(io.BytesIO(data)).load()
