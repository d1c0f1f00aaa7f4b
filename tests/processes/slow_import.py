"""A module whose import, in a server process, goes on until the test releases it (an
import of seconds, torch's first, say). The module connects to a socket the test listens
on (127.0.0.1, its port in the servers' env) and blocks reading it: the connection tells
the test the import started, a byte (or the test closing it) ends the import, and 50 s
without either fails it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

_MODULE = """
import os, socket

_port = os.environ.get("PSTRAIN_TEST_IMPORT_PORT")
if _port:
    with socket.create_connection(("127.0.0.1", int(_port)), timeout=50) as _released:
        _released.recv(1)  # until the test releases it; socket.timeout after 50 s


class Payload:
    def __init__(self, value):
        self.value = value
"""


@dataclass
class SlowImport:
    module: ModuleType  # imported here at once: only ``env`` names the port
    env: dict[str, str]  # for the servers' processes
    started: asyncio.Event = field(default_factory=asyncio.Event)  # a server's import began
    _waiting: list[asyncio.StreamWriter] = field(default_factory=list)

    def release(self) -> None:
        """End every import waiting now."""
        for writer in self._waiting:
            writer.close()
        self._waiting.clear()

    def _connected(self, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._waiting.append(writer)
        self.started.set()


@contextlib.asynccontextmanager
async def slow_import(tmp_path: Path) -> AsyncIterator[SlowImport]:
    """The module ``pstrain_slow_to_import`` (class ``Payload``) in ``tmp_path``."""
    (tmp_path / "pstrain_slow_to_import.py").write_text(_MODULE)
    sys.path.insert(0, str(tmp_path))
    slow: SlowImport | None = None
    server: asyncio.Server | None = None
    try:
        import pstrain_slow_to_import

        path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
        slow = SlowImport(pstrain_slow_to_import, {})
        server = await asyncio.start_server(slow._connected, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        slow.env = dict(os.environ, PSTRAIN_TEST_IMPORT_PORT=str(port), PYTHONPATH=path)
        yield slow
    finally:
        if slow is not None:
            slow.release()  # a server still importing ends (the test failed)
        if server is not None:
            server.close()
            await server.wait_closed()
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pstrain_slow_to_import", None)
