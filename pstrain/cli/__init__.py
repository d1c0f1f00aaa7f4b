"""The ``pstrain`` command: ``serve`` one task, ``status`` of a cluster, ``demo``, ``launch``
a local cluster.

This is the edge where configuration is read (flags, ``TF_CONFIG``, ``PSTRAIN_CONFIG``,
``PSTRAIN_TOKEN``) and where logging is set up; what is read is passed down as values.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .._base.errors import PstrainError
from .threads import presize_serve

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"] and "--own-process-group" in argv:
        leave_process_group()
    # Before numpy or PyTorch load (the subcommands' modules import them): they size their
    # thread pools once, from the environment.
    sized = presize_serve(argv, os.environ)
    from .serve import serve, serve_parser
    from .status import status_parser

    parser = argparse.ArgumentParser(prog="pstrain", description="Parameter-server training runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    status_parser(sub)
    from ..demo import add_demo_parser

    add_demo_parser(sub)
    from ..launch import add_launch_parser

    add_launch_parser(sub)
    args = parser.parse_args(argv)
    args.threads_sized = sized
    try:
        return int(args.func(args)) if hasattr(args, "func") else serve(args)
    except PstrainError as exc:
        print(f"pstrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def leave_process_group() -> None:
    """Lead a process group of this process's own (unless it does already), first thing:
    a terminal's Ctrl-C goes to the foreground group, the starter's, which passes it on.
    Not a session of its own: Linux shares the CPU between sessions (autogroups) before
    the threads in them, so a task in a session of its own would take a whole share
    whatever its threads' priorities, and a save's writer thread at a lower priority
    would still take CPU from the workers beside it."""
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)

