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

from .. import __version__
from .._base.errors import PstrainError
from .threads import pin_serve, presize_serve

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before numpy or PyTorch load (the subcommands' modules import them): they size their
    # thread pools once, from the environment.
    sized = presize_serve(argv, os.environ)
    pinned = pin_serve(argv)  # before any thread starts: each one it starts inherits the cores
    from .serve import serve, serve_parser
    from .status import status_parser

    parser = argparse.ArgumentParser(prog="pstrain", description="Parameter-server training runtime.")
    parser.add_argument("--version", action="version", version=f"pstrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub)
    status_parser(sub)
    from .dashboard_login import dashboard_login_parser

    dashboard_login_parser(sub)
    from ..demo import add_demo_parser

    add_demo_parser(sub)
    from .launch import add_launch_parser

    add_launch_parser(sub)
    args = parser.parse_args(argv)
    args.threads_sized = sized
    args.cpus_pinned = pinned
    try:
        return int(args.func(args)) if hasattr(args, "func") else serve(args)
    except PstrainError as exc:
        print(f"pstrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
