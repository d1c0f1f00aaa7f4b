"""Every module of pstrain imports alone, in a fresh interpreter: none leans on another
having been imported first (``tests/unit/test_architecture.py`` checks the import graph
itself)."""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import ROOT


def modules() -> list[str]:
    """Every module of the package, by its dotted name."""
    names = []
    for path in sorted((ROOT / "pstrain").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


#: Run by each helper interpreter: the third-party libraries are imported once, then each
#: pstrain module is imported in a child forked from that state (pstrain itself not loaded),
#: so every module still imports with none of pstrain before it, at a third of the cost.
_FORK_EACH = """
import os, sys, traceback
import numpy, msgpack, aiohttp, aiohttp.web, cloudpickle, msgspec, xxhash  # noqa: F401, E401
import prometheus_client, prometheus_client.core  # noqa: F401 - not pstrain: loaded once, shared
assert not any(m == "pstrain" or m.startswith("pstrain.") for m in sys.modules)
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc()[-2000:].encode())
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        err = f.read().decode()
    _, status = os.waitpid(pid, 0)
    print(repr((name, os.waitstatus_to_exitcode(status), err)), flush=True)
"""


def _import_alone(names: list[str]) -> list[tuple[str, int, str]]:
    out = subprocess.run(
        [sys.executable, "-c", _FORK_EACH, *names], capture_output=True, text=True, timeout=150
    )
    results = [ast.literal_eval(line) for line in out.stdout.splitlines()]
    if out.returncode != 0 or len(results) != len(names):
        results.append(("(the helper)", out.returncode or 1, out.stderr[-2000:]))
    return results


@pytest.mark.timeout(180)
def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = modules()
    with ThreadPoolExecutor(2) as pool:  # two helpers: the machine's two cores
        results = [r for batch in pool.map(_import_alone, [names[0::2], names[1::2]]) for r in batch]
    failed = [f"{m}: {err}" for m, code, err in results if code != 0]
    assert len(results) == len(names) > 40
    assert not failed, "\n".join(failed)
