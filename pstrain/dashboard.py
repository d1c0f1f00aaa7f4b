"""The live dashboard: the coordinator serves a page that draws the cluster as it runs.

``url = await pstrain.dashboard.serve_dashboard(coordinator)`` (or ``pstrain
launch --dashboard``, ``pstrain demo --dashboard``) listens on 127.0.0.1 by
default and returns a *one-time* login URL (``/login?key=...``): opening it
sets a session cookie (HttpOnly, SameSite=Strict) and the key is spent;
without the cookie every page and stream answers 401.
``pstrain.dashboard.login_url(coordinator)`` makes a fresh key, and so does
``pstrain dashboard-login HOST:PORT`` (``POST /login/new`` with the cluster token) for a
running job. A bearer
header with the cluster token also works, for scripts. It is an add-on of the
face layer: it reads the coordinator through its public API and attaches
through ``coordinator.extensions``, ``on_close`` and ``START_HOOKS``.

The browser opens one server-sent-event stream (``/events``); the
coordinator builds a snapshot about once a second while someone watches (it
asks each ps for its statistics itself: the browser never polls the tasks)
and sends it to every open stream: every task (up / down / joining /
draining, address, incarnation), closures per second, queue depth, each
worker's throughput and failures, each ps's memory, variables, tables,
requests and bytes per second, each dynamic table (rows, capacity, admitted
and evicted per second, bytes), the scalars logged with :mod:`pstrain.summary`
(smoothed, the raw values on hover), and the checkpoints saved. When the
coordinator closes, the page says the job finished. The charts are uPlot (vendored, MIT): no internet needed.
With nobody watching it costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ._base.auth import bearer_ok
from ._base.cluster import is_loopback
from ._base.errors import InvalidArgumentError, PstrainError
from ._checkpoint.checkpoint import recent_saves
from ._coordinator import coordinator as coordinator_module
from ._coordinator.coordinator import ClusterCoordinator
from ._formats.messages.operations import Health, Statistics
from ._formats.messages.records import HealthReply, Operation, R
from ._serving.base import ServerBase
from ._training import summary

logger = logging.getLogger(__name__)

__all__ = ["Dashboard", "login_url", "of", "serve_dashboard", "snapshot", "task_state"]

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboard_static")
COOKIE = "pstrain_dashboard"
PERIOD_S = 1.0
#: Unused login keys kept at most (each ``dashboard_login_url()`` makes one).
MAX_KEYS = 64


class Dashboard(ServerBase):
    """The dashboard of one coordinator; see the module docstring. A server on the same core
    as the ps, the workers and the coordinator's endpoint (one port, pre-auth deadlines and
    limits, TLS): its pages check the browser's session themselves."""

    def __init__(
        self, snapshot: Callable[[], Any], token: str | None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        super().__init__("dashboard", 0, host=host, port=port, token=token)
        self._snapshot = snapshot  # async: the coordinator's state, as plain JSON values
        self._keys: set[str] = set()
        self._sessions: set[str] = set()
        self._clients: set[asyncio.Queue[bytes]] = set()
        self._no_clients = asyncio.Event()  # set while no stream is open
        self._no_clients.set()
        self._ticker: asyncio.Task[None] | None = None
        self.snapshots = 0  # built so far (tests and benchmarks read it)
        self.page("GET", "/login", self._login)
        self.page("POST", "/login/new", self._new_login)
        self.page("GET", "/", self._index)
        self.page("GET", "/events", self._events)
        self.page("GET", "/api/state", self._state)
        self.page("GET", "/static/{name}", self._static)

    # -- lifecycle ------------------------------------------------------------------------------
    async def before_stop(self) -> None:
        """The job is over: every open page is told so (and stops reconnecting) before the
        streams close, within a second."""
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None
        finished = _event({"finished": True, "time": time.time()})
        for q in list(self._clients):
            while q.maxsize and q.qsize() > q.maxsize - 2:  # a stalled browser: oldest first
                q.get_nowait()
            q.put_nowait(finished)
            q.put_nowait(b"")  # ends each stream
        with contextlib.suppress(TimeoutError):  # the streams write it and end themselves
            await asyncio.wait_for(self._no_clients.wait(), 1.0)

    def login_url(self) -> str:
        """A fresh one-time URL that logs a browser in."""
        if self.address is None:
            raise PstrainError("the dashboard is not started")
        if len(self._keys) >= MAX_KEYS:
            self._keys.pop()
        key = secrets.token_urlsafe(24)
        self._keys.add(key)
        return f"http://{self.address}/login?key={key}"

    # -- access -----------------------------------------------------------------------------------
    def _allowed(self, request: web.Request, authenticated: Callable[[], None]) -> bool:
        session = request.cookies.get(COOKIE)
        ok = session is not None and any(hmac.compare_digest(session, s) for s in self._sessions)
        if not ok:
            ok = self.token_bytes is not None and bearer_ok(
                request.headers.get("Authorization"), self.token_bytes
            )
        if ok:
            authenticated()
        return ok

    def _refuse(self) -> web.Response:
        return web.Response(
            status=401,
            content_type="text/html",
            text=(
                "<!doctype html><title>pstrain dashboard</title><h1>401: not logged in</h1>"
                "<p>Open the one-time URL the coordinator printed, or make a new one: "
                f"<code>pstrain dashboard-login {self.address}</code> (with the cluster's token: "
                "<code>--token-file</code> or <code>PSTRAIN_TOKEN</code>), or, in the program, "
                "<code>pstrain.dashboard.login_url(coordinator)</code>.</p>"
            ),
        )

    async def _new_login(self, request: web.Request, authenticated: Callable[[], None]) -> web.StreamResponse:
        """``POST /login/new``: a fresh one-time login URL, for the cluster's token (without
        one, for a caller on this machine only: the dashboard then listens on loopback)."""
        if self.token_bytes is not None:
            ok = bearer_ok(request.headers.get("Authorization"), self.token_bytes)
        else:
            ok = is_loopback(request.remote or "")
        if not ok:
            return web.json_response(
                {
                    "error": {
                        "type": "AuthenticationError",
                        "message": "missing or wrong cluster token: send 'Authorization: Bearer <token>'",
                    }
                },
                status=401,
            )
        authenticated()
        return web.json_response({"url": self.login_url()})

    async def _login(self, request: web.Request, authenticated: Callable[[], None]) -> web.StreamResponse:
        key = request.query.get("key", "")
        found = next((k for k in self._keys if hmac.compare_digest(k, key)), None)
        if found is None:
            return self._refuse()
        self._keys.discard(found)  # one time
        authenticated()
        session = secrets.token_urlsafe(32)
        self._sessions.add(session)
        found_page = web.HTTPFound("/")
        found_page.set_cookie(COOKIE, session, httponly=True, samesite="Strict", path="/")
        raise found_page

    # -- pages -------------------------------------------------------------------------------------
    async def _index(self, request: web.Request, authenticated: Callable[[], None]) -> web.StreamResponse:
        if not self._allowed(request, authenticated):
            return self._refuse()
        return web.FileResponse(os.path.join(STATIC, "index.html"), headers={"Cache-Control": "no-store"})

    async def _static(self, request: web.Request, authenticated: Callable[[], None]) -> web.StreamResponse:
        if not self._allowed(request, authenticated):
            return self._refuse()
        name = request.match_info["name"]
        if name not in ("uPlot.iife.min.js", "uPlot.min.css", "dashboard.js"):
            raise web.HTTPNotFound()
        return web.FileResponse(os.path.join(STATIC, name))

    async def _state(self, request: web.Request, authenticated: Callable[[], None]) -> web.StreamResponse:
        if not self._allowed(request, authenticated):
            return self._refuse()
        return web.json_response(await self._full())

    async def _full(self) -> dict[str, Any]:
        state: dict[str, Any] = await self._snapshot()
        _, state["scalars"] = summary.LOG.since(0)
        return state

    async def _events(self, request: web.Request, authenticated: Callable[[], None]) -> web.StreamResponse:
        if not self._allowed(request, authenticated):
            return self._refuse()
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)
        first = await self._full()  # everything so far, then what is new each second
        await response.write(_event(first))
        self._clients.add(queue)
        self._no_clients.clear()
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        try:
            while True:
                data = await queue.get()
                if not data:
                    break
                await response.write(data)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._clients.discard(queue)
            if not self._clients:
                self._no_clients.set()
        return response

    async def _tick(self) -> None:
        """About once a second while anyone watches: one snapshot, sent to every stream."""
        seq, _ = summary.LOG.since(1 << 62)
        while self._clients:
            started = time.monotonic()
            try:
                state: dict[str, Any] = await self._snapshot()
                seq, state["scalars"] = summary.LOG.since(seq)
                self.snapshots += 1
                data = _event(state)
                for q in list(self._clients):
                    if q.full():  # a stalled browser: drop its oldest update
                        q.get_nowait()
                    q.put_nowait(data)
            except Exception:  # a snapshot must not kill the dashboard
                logger.warning("the dashboard could not build a snapshot", exc_info=True)
            await asyncio.sleep(max(0.05, PERIOD_S - (time.monotonic() - started)))


def _event(state: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(state, separators=(",", ":"), default=str).encode() + b"\n\n"


def task_state(up: bool, leaving: bool, seen: bool) -> str:
    """How the dashboard names a task's state."""
    if leaving:
        return "draining"
    if up:
        return "up"
    return "down" if seen else "joining"


# -- the coordinator's dashboard ------------------------------------------------------------------
async def serve_dashboard(coordinator: ClusterCoordinator, host: str = "127.0.0.1", port: int = 0) -> str:
    """Serve ``coordinator``'s live dashboard (once; later calls reuse it) and return a
    one-time login URL. Off loopback the cluster must have a token."""
    dashboard = of(coordinator)
    if dashboard is None:
        token = coordinator.strategy.channels.token
        if not is_loopback(host) and not token:
            raise InvalidArgumentError("a dashboard off loopback needs a cluster token")
        dashboard = Dashboard(lambda: snapshot(coordinator), token, host, port)
        await dashboard.start()
        coordinator.extensions["dashboard"] = dashboard
        coordinator.on_close(dashboard.stop)
    return dashboard.login_url()


def of(coordinator: ClusterCoordinator) -> Dashboard | None:
    """The dashboard ``coordinator`` serves, if any."""
    dashboard: Dashboard | None = coordinator.extensions.get("dashboard")
    return dashboard


def login_url(coordinator: ClusterCoordinator) -> str:
    """A fresh one-time login URL for ``coordinator``'s dashboard."""
    dashboard = of(coordinator)
    if dashboard is None:
        raise PstrainError("no dashboard: call pstrain.dashboard.serve_dashboard(coordinator) first")
    return dashboard.login_url()


async def _call(
    coordinator: ClusterCoordinator, job: str, index: int, message: Operation[R], timeout: float
) -> R | None:
    try:
        return await coordinator.strategy.channels.channel(job, index).request(message, timeout=timeout)
    except PstrainError:
        return None


async def snapshot(coordinator: ClusterCoordinator) -> dict[str, Any]:
    """What the dashboard shows, as plain values (built about once a second while watched).
    It asks each ps for its statistics and each worker for its health itself: an idle worker
    that died shows as down at once, before dispatching would learn of it."""
    spec = coordinator.strategy.channels.cluster_spec
    members = coordinator.membership()
    st = coordinator.statistics()
    placement = st["placement"]  # which ps is in the job, its share, the move under way
    left = {p["index"] for p in placement["ps"] if not p["active"]}
    known = coordinator.ps_incarnations  # a ps that joined later is not in it
    incarnations = [known[k] if k < len(known) else None for k in range(len(placement["ps"]))]

    async def ps_statistics(k: int) -> dict[str, Any] | None:
        return None if k in left else await _call(coordinator, "ps", k, Statistics(), 2.0)

    async def worker_health(m: dict[str, Any]) -> HealthReply | None:
        return await _call(coordinator, "worker", m["index"], Health(), 1.0) if m["up"] else None

    stats, answers = await asyncio.gather(
        asyncio.gather(*(ps_statistics(k) for k in range(len(incarnations)))),
        asyncio.gather(*(worker_health(m) for m in members)),
    )
    chief = spec.task_address("chief", 0) if spec.num_tasks("chief") else None
    tasks: list[dict[str, Any]] = [
        {"job": "chief", "index": 0, "task": "chief:0", "state": "up", "address": chief or "this process"}
    ]
    for k, ps_st in enumerate(stats):
        entry: dict[str, Any] = {
            "job": "ps",
            "index": k,
            "task": f"ps:{k}",
            "address": placement["ps"][k]["address"] or "(left)",
            "state": "left"
            if k in left
            else "up"
            if ps_st is not None
            else ("down" if incarnations[k] else "joining"),
            "incarnation": incarnations[k],
        }
        if ps_st is not None:
            requests = ps_st.get("requests", {}).values()
            entry.update(
                bytes=ps_st.get("bytes", 0),
                variables=ps_st.get("variables", 0),
                rss_bytes=ps_st.get("rss_bytes"),
                tables=ps_st.get("tables", {}),
                requests=sum(r["count"] for r in requests),
                wire_bytes=sum(r["bytes_in"] + r["bytes_out"] for r in requests),
            )
        tasks.append(entry)
        # a ps's share counts its table rows too (the map knows its variables' bytes only)
        table_bytes = sum(int(t.get("bytes", 0)) for t in (ps_st or {}).get("tables", {}).values())
        placement["ps"][k] = {
            **placement["ps"][k],
            "table_bytes": table_bytes,
            "bytes": placement["ps"][k]["bytes"] + table_bytes,
        }
    for m, answered in zip(members, answers):
        seen = m["incarnation"] is not None or m["failures"] > 0
        tasks.append(
            {
                "job": "worker",
                "index": m["index"],
                "task": f"worker:{m['index']}",
                "address": m["address"],
                "state": task_state(m["up"] and answered is not None, m["leaving"], seen),
                "incarnation": m["incarnation"],
                "failures": m["failures"],
                "completed": m["completed"],
                "last_error": m["last_error"],
            }
        )
    return {
        "time": time.time(),
        "tasks": tasks,
        "placement": placement,
        "closures": {
            "done": st["closures_done"],
            "queued": st["queued"],
            "in_flight": st["in_flight"],
            "retried": st["closures_retried"],
            "worker_failures": st["worker_failures"],
        },
        "checkpoints": recent_saves(),
    }


def _start_from_environment(coordinator: ClusterCoordinator) -> None:
    """``pstrain launch --dashboard`` sets PSTRAIN_DASHBOARD for the program it runs: its
    coordinator serves the dashboard there and prints the login URL."""
    where = os.environ.get("PSTRAIN_DASHBOARD")
    if not where:
        return

    async def start() -> None:
        host, _, port = where.rpartition(":")
        try:
            url = await serve_dashboard(coordinator, host or "127.0.0.1", int(port or 0))
        except (PstrainError, ValueError, OSError) as exc:
            logger.error("the dashboard could not start on %s: %s", where, exc)
            return
        print(f"pstrain dashboard (one-time login URL; open it once): {url}", file=sys.stderr, flush=True)

    coordinator.run_in_background(start())


if _start_from_environment not in coordinator_module.START_HOOKS:
    coordinator_module.START_HOOKS.append(_start_from_environment)
