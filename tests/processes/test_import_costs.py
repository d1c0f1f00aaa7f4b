"""Importing pstrain in a fresh interpreter: cheap, no side effects, classes pickled by reference."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any

import pstrain
from pstrain import rpc
from pstrain.testing import untyped_call
from tests.helpers import TOKEN, ServeProcess


def test_import_is_cheap_and_has_no_side_effects():
    code = (
        "import sys, pstrain; heavy = [m for m in ('aiohttp', 'numpy', 'cloudpickle', 'uvloop') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_class_pickles_by_reference_before_its_facade_is_imported():
    # cloudpickle sends by value a class whose module is not imported yet: a worker would
    # get a copy of the class (and `super()` in its methods fails there). pstrain imports
    # the public module first, as the standard pickle does.
    code = (
        "import sys, pickle\n"
        "from pstrain._training.optimizers import Adagrad\n"
        "from pstrain._formats.messages.pickling import dumps_object\n"
        "assert 'pstrain.optimizers' not in sys.modules\n"
        "data = dumps_object(Adagrad(0.1))\n"
        "assert pickle.loads(data).__class__ is Adagrad, 'not the same class'\n"
        "print(b'_make_skeleton_class' in data)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "the class went by value"


def test_a_server_loads_aiohttp_only_when_a_connection_speaks_http():
    # aiohttp costs a process about 0.3 s of CPU to import, and most servers of a job never
    # serve HTTP (the coordinator and the workers reach them by the stream).
    server = ServeProcess("--role", "ps", "--index", "0", "--port", "0")
    try:

        def loaded() -> bool:
            with open(f"/proc/{server.proc.pid}/maps") as maps:
                return "/aiohttp/" in maps.read()

        async def stream() -> Any:
            channel = rpc.Channel(server.address, token=TOKEN, task="ps0")
            try:
                return await untyped_call(channel, "vars/list", {})
            finally:
                await channel.close()

        assert pstrain.run(stream()) == {"variables": []}
        assert not loaded(), "aiohttp was loaded before any HTTP request"
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: ps\r\nConnection: close\r\n\r\n")
            assert conn.makefile("rb").readline().startswith(b"HTTP/1.1 401")  # (no token given)
        assert loaded()
    finally:
        server.stop()
