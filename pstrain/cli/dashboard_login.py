"""``pstrain dashboard-login HOST:PORT``: a fresh one-time login URL for a running job's
dashboard (the one the coordinator printed is spent once a browser opened it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .._base.errors import AuthenticationError, PstrainError, UnavailableError
from .._base.resolvers import read_token
from .arguments import address, seconds

__all__ = ["dashboard_login", "dashboard_login_parser"]


def dashboard_login_parser(sub: Any) -> None:
    p = sub.add_parser(
        "dashboard-login",
        help="print a new one-time login URL of a dashboard",
        description="Ask a running job's dashboard (the address `pstrain launch "
        "--dashboard` printed) for a new one-time login URL, with the "
        "cluster token (--token-file, else PSTRAIN_TOKEN, else "
        "PSTRAIN_TOKEN_FILE; a cluster without one: from its machine).",
    )
    p.add_argument("dashboard", type=address, metavar="HOST:PORT", help="the dashboard's address")
    p.add_argument("--token-file", metavar="FILE", help="file holding the cluster token")
    p.add_argument("--timeout", type=seconds, default=10.0, help="seconds to wait for an answer")
    p.set_defaults(func=dashboard_login)


def dashboard_login(args: argparse.Namespace) -> int:
    # (imported here: every `pstrain` command builds this parser, and urllib's HTTP client
    # costs a process about 50 ms of CPU, a `pstrain serve` one among them)
    import urllib.error
    import urllib.request

    token = read_token(os.environ, args.token_file)
    request = urllib.request.Request(
        f"http://{args.dashboard}/login/new",
        data=b"",
        method="POST",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as reply:  # noqa: S310 (http only)
            url = json.loads(reply.read())["url"]
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise AuthenticationError(
                f"the dashboard at {args.dashboard} refused the token: give "
                "the cluster's (--token-file or PSTRAIN_TOKEN)"
            ) from None
        raise PstrainError(f"the dashboard at {args.dashboard} answered {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UnavailableError(
            f"no dashboard answers at {args.dashboard}: {getattr(exc, 'reason', exc)}"
        ) from None
    print(url, file=sys.stdout)
    return 0
