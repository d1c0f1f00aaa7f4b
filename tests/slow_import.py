"""A module whose import, in a server process, goes on until the test releases it (an
import of seconds, torch's first, say): the servers' env names two files, one the module
touches when its import starts, one the test touches to end it."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

_MODULE = """
import os, pathlib, time

_mark, _release = os.environ.get("PSTRAIN_TEST_IMPORT_MARK"), os.environ.get("PSTRAIN_TEST_IMPORT_RELEASE")
if _mark and _release:
    pathlib.Path(_mark).touch()
    _deadline = time.monotonic() + 50
    while not os.path.exists(_release):
        if time.monotonic() > _deadline:
            raise RuntimeError("the test never released this import")
        time.sleep(0.02)


class Payload:
    def __init__(self, value):
        self.value = value
"""


@dataclass
class SlowImport:
    module: ModuleType  # imported here at once: only ``env`` names the files
    env: dict[str, str]  # for the servers' processes
    started: Path  # exists once a server's import started
    release: Path  # touch it to end the import

    def importing(self) -> bool:
        return self.started.exists()


@contextlib.contextmanager
def slow_import(tmp_path: Path) -> Iterator[SlowImport]:
    """The module ``pstrain_slow_to_import`` (class ``Payload``) in ``tmp_path``."""
    (tmp_path / "pstrain_slow_to_import.py").write_text(_MODULE)
    started, release = tmp_path / "importing", tmp_path / "release"
    sys.path.insert(0, str(tmp_path))
    try:
        import pstrain_slow_to_import

        path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PSTRAIN_TEST_IMPORT_MARK=str(started),
                   PSTRAIN_TEST_IMPORT_RELEASE=str(release), PYTHONPATH=path)
        yield SlowImport(pstrain_slow_to_import, env, started, release)
    finally:
        release.touch()  # a server still importing ends (the test failed)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pstrain_slow_to_import", None)
