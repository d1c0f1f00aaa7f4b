"""Prometheus metrics for every task, collected when scraped.

Servers keep plain counters (requests, bytes, seconds per operation); a
collector turns them into Prometheus families only when ``GET /metrics`` is
asked, so serving a request costs one timer read and a few additions. Each
server has its own registry (several may share a process in tests).

The coordinator is not a server, yet it has counters too (queued, in flight,
retried): :class:`MetricsEndpoint` serves them (``GET /metrics`` and
``/healthz``, token-protected like every server).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from .._base.auth import bearer_ok
from .._base.cluster import listening_socket
from .._base.errors import PstrainError

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "MetricsEndpoint", "make_registry", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Collector:
    def __init__(self, labels: dict[str, str], stats: Callable[[], dict[str, Any]]) -> None:
        self.labels = labels
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        names, values = list(self.labels), list(self.labels.values())
        requests = CounterMetricFamily("pstrain_requests", "Requests served, by operation",
                                       labels=[*names, "op"])
        bytes_in = CounterMetricFamily("pstrain_request_received_bytes", "Request body bytes received",
                                       labels=[*names, "op"])
        bytes_out = CounterMetricFamily("pstrain_reply_sent_bytes", "Reply body bytes sent",
                                        labels=[*names, "op"])
        latency = SummaryMetricFamily("pstrain_request_seconds", "Time spent handling requests",
                                      labels=[*names, "op"])
        for op, r in s.get("requests", {}).items():
            requests.add_metric([*values, op], r["count"])
            bytes_in.add_metric([*values, op], r["bytes_in"])
            bytes_out.add_metric([*values, op], r["bytes_out"])
            latency.add_metric([*values, op], count_value=r["count"], sum_value=r.get("seconds", 0.0))
        yield from (requests, bytes_in, bytes_out, latency)
        for key, (kind, help_text, *metric) in _EXTRA.items():
            if key in s and s[key] is not None:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    f"pstrain_{metric[0] if metric else key}", help_text, labels=names)
                family.add_metric(values, float(s[key]))
                yield family
        if "closure_seconds" in s:
            fam = SummaryMetricFamily("pstrain_worker_closure_seconds", "Closure run time",
                                      labels=names)
            fam.add_metric(values, count_value=s.get("closures_run", 0) + s.get("closures_failed", 0),
                           sum_value=s["closure_seconds"])
            yield fam
        tables = s.get("tables")
        if tables:
            for key, kind, help_text in _TABLE:
                family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                    f"pstrain_table_{key}", help_text, labels=[*names, "table"])
                for table, t in sorted(tables.items()):
                    family.add_metric([*values, table], float(t[key]))
                yield family
        up = GaugeMetricFamily("pstrain_uptime_seconds", "Seconds since the server started", labels=names)
        up.add_metric(values, s.get("uptime_s", 0.0))
        yield up


#: statistics key -> (kind, help, metric name if not the key): units in names, counters
#: exported with ``_total``, labels ``role`` and ``task`` (the task's index).
_EXTRA: dict[str, tuple[str, ...]] = {
    "preauth_waiting": ("gauge", "Connections waiting to authenticate"),
    "preauth_expired": ("counter", "Connections closed for not authenticating in time"),
    "preauth_evicted": ("counter", "Waiting connections dropped to make room (the cap)"),
    "rss_bytes": ("gauge", "Resident memory of this process", "resident_memory_bytes"),
    "variables": ("gauge", "Variables held by this ps"),
    "bytes": ("gauge", "Bytes of variables held by this ps", "variable_bytes"),
    "closures_run": ("counter", "Closures this worker ran successfully"),
    "closures_failed": ("counter", "Closures that raised on this worker"),
    "closures_running": ("gauge", "Closures running on this worker now"),
    "resources": ("gauge", "Per-worker resources (datasets, iterators) on this worker"),
    "queued": ("gauge", "Closures queued on the coordinator"),
    "in_flight": ("gauge", "Closures running on workers"),
    "closures_done": ("counter", "Closures finished (any outcome)"),
    "closures_retried": ("counter", "Closures put back after their worker failed"),
    "worker_failures": ("counter", "Worker failures seen by the coordinator"),
}


_TABLE = (("rows", "gauge", "Rows a dynamic table holds on this ps"),
          ("admitted", "counter", "Rows admitted into a dynamic table on this ps"),
          ("evicted", "counter", "Rows evicted from a dynamic table on this ps"),
          ("bytes", "gauge", "Bytes a dynamic table takes on this ps (rows, slots, index)"))


def make_registry(labels: dict[str, str], stats: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(labels, stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)


class MetricsEndpoint:
    """``GET /metrics`` and ``/healthz`` for a task that is not a server (the coordinator).

    ``await start()`` binds (port 0 picks one) and returns the address.
    """

    def __init__(self, task: str, labels: dict[str, str], stats: Callable[[], dict[str, Any]], *,
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 join: Callable[[str], Awaitable[int]] | None = None,
                 membership: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.task = task
        self.host = host
        self.port = port
        self._token = token.encode() if token else None
        self._started = time.time()
        self._stats = stats
        self._join = join
        self._membership = membership
        self._registry = make_registry(labels, lambda: {"uptime_s": time.time() - self._started,
                                                        **stats()})
        self._runner: web.AppRunner | None = None
        self.address: str | None = None

    async def start(self) -> str:
        sock = listening_socket(self.host, self.port, f"{self.task}'s /metrics", backlog=128)
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._health)
        if self._join is not None:
            app.router.add_post("/v1/join", self._joined)
        if self._membership is not None:
            app.router.add_get("/v1/membership", self._members)
        app.router.add_get("/v1/statistics", self._statistics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("%s serves /metrics on %s", self.task, self.address)
        return self.address

    def _authorized(self, request: web.Request) -> bool:
        return bearer_ok(request.headers.get("Authorization"), self._token)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"type": "AuthenticationError", "message":
                                      "missing or wrong cluster token: send 'Authorization: "
                                      "Bearer <token>'", "task": self.task}}, status=401)
        return web.Response(body=render(self._registry), headers={"Content-Type": CONTENT_TYPE})

    def _refusal(self) -> web.Response:
        return web.json_response({"error": {"type": "AuthenticationError", "message":
                                  "missing or wrong cluster token: send 'Authorization: "
                                  "Bearer <token>'", "task": self.task}}, status=401)

    async def _joined(self, request: web.Request) -> web.Response:
        """``POST /v1/join {"address": "host:port"}``: a worker asks to take a vacant slot."""
        if not self._authorized(request):
            return self._refusal()
        try:
            if request.content_length is None or request.content_length > 4096:
                raise ValueError("a body of at most 4 KiB, with its Content-Length, is required")
            address = json.loads(await request.read()).get("address")
            if not isinstance(address, str) or not address:
                raise ValueError("missing 'address'")
            assert self._join is not None
            index = await self._join(address)
        except PstrainError as exc:
            return web.json_response({"error": {"type": type(exc).__name__, "message": str(exc),
                                                "task": self.task}}, status=exc.http_status)
        except (ValueError, AttributeError, UnicodeDecodeError) as exc:
            return web.json_response({"error": {"type": "InvalidArgumentError", "message":
                                                f"join needs a JSON body {{\"address\": \"host:port\"}}: {exc}",
                                                "task": self.task}}, status=400)
        return web.json_response({"index": index})

    async def _members(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._refusal()
        assert self._membership is not None
        return web.json_response({"workers": self._membership()})

    async def _statistics(self, request: web.Request) -> web.Response:
        """``GET /v1/statistics``: what ``pstrain status`` shows of the coordinator."""
        if not self._authorized(request):
            return self._refusal()
        return web.json_response({"task": self.task, "uptime_s": time.time() - self._started,
                                  **self._stats()})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "running", "task": self.task})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
