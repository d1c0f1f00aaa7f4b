"""The HTTP face of a server (aiohttp): ``POST /v1/<op>``, ``/metrics``, ``/healthz``,
and a server's own ``GET`` downloads (the ps's table feed).

For clients other than pstrain's own (curl, Prometheus, another language):
the bearer token is checked by a middleware before the body is read; the
body grows as its bytes arrive (capped by its ``Content-Length`` and the
server's ``max_body``; compressed bodies are refused) and goes through the
same :meth:`ServerCore.handle` as a stream frame. Idle keep-alive connections
close after ``keepalive_s``. Errors come back as JSON (``{"error": {type, message, task}}``)
with the error's HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from .._base.auth import bearer_ok
from .._base.errors import (
    AuthenticationError,
    InvalidArgumentError,
    ProtocolError,
    PstrainError,
    status_for,
    to_envelope,
)
from .._formats.messages.operations import Health
from .._formats.observability import CONTENT_TYPE as METRICS_TYPE, make_registry, render
from .._transport.frames import CONTENT_TYPE, FrameKind
from .._transport.listener import Reply

if TYPE_CHECKING:
    from .core import ServerCore

__all__ = ["HttpAdapter"]

_PIECE = 1 << 20  # bytes of a download written at once
#: Seconds a piece of a download may wait for the peer to take it.
SEND_TIMEOUT_S = 30.0
logger = logging.getLogger(__name__)


class HttpAdapter:
    """An aiohttp application serving one server's handler table."""

    def __init__(
        self, server: ServerCore, authenticated: Callable[[asyncio.BaseTransport], None] | None = None
    ) -> None:
        self.server = server
        self.authenticated = authenticated  # told of each connection past the token check
        self._runner: web.AppRunner | None = None
        self._registry: Any = None
        self._pages: set[Any] = set()  # the routes of the server's pages

    async def start(self) -> Any:
        """Set the application up; returns the protocol factory the sniffer hands HTTP to."""

        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self._auth(request, handler)

        app = web.Application(middlewares=[auth], client_max_size=self.server.max_body)
        app.router.add_route("POST", "/v1/{op:.+}", self._op)
        app.router.add_route("GET", "/v1/health", self._health)
        app.router.add_route("GET", "/healthz", self._health)
        app.router.add_route("GET", "/metrics", self._metrics)
        for path, serve in self.server.downloads.items():
            app.router.add_route("GET", path, self._download(serve))
        for (method, path), page in self.server.pages.items():
            self._pages.add(app.router.add_route(method, path, self._page(page)))
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, keepalive_timeout=self.server.keepalive_s
        )
        await self._runner.setup()
        factory = self._runner.server
        assert factory is not None
        return factory

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _page(self, page: Any) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            def authenticated() -> None:  # the page checked the request: no pre-auth deadline
                if request.transport is not None and self.authenticated is not None:
                    self.authenticated(request.transport)

            response: web.StreamResponse = await page(request, authenticated)
            return response

        return handle

    def _download(self, serve: Any) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                twice = sorted({k for k in request.query if len(request.query.getall(k)) > 1})
                if twice:  # (a dict of them would keep one and drop the others unsaid)
                    raise InvalidArgumentError(f"query parameter(s) {twice} given more than once")
                download = await serve(dict(request.match_info), dict(request.query))
            except PstrainError as exc:
                return self._json_error(exc)
            try:
                return await self._send(request, download)
            finally:
                if download.close is not None:
                    download.close()

        return handle

    async def _send(self, request: web.Request, download: Any) -> web.StreamResponse:
        """Send a download in pieces, each given ``SEND_TIMEOUT_S`` to leave: the send buffer
        stays small, the peer paces it, and a peer that stops reading is dropped."""
        chunks = [memoryview(c).cast("B") for c in download.chunks]
        response = web.StreamResponse(
            headers={
                "Content-Type": download.content_type,
                **(download.headers or {}),
                "Content-Length": str(sum(len(c) for c in chunks) + download.length),
            }
        )
        await response.prepare(request)

        async def write(chunk: memoryview) -> None:
            for at in range(0, len(chunk), _PIECE):
                await asyncio.wait_for(response.write(chunk[at : at + _PIECE]), SEND_TIMEOUT_S)

        try:
            for chunk in chunks:
                await write(chunk)
            if download.stream is not None:
                sent = 0
                while (piece := await asyncio.to_thread(next, download.stream, None)) is not None:
                    piece = memoryview(piece).cast("B")
                    sent += len(piece)
                    await write(piece)
                if sent != download.length:
                    raise ProtocolError(f"download made {sent} bytes, not {download.length}")
            await response.write_eof()
        except (TimeoutError, PstrainError, OSError) as exc:
            # The status went out with the headers: the peer sees the body cut short.
            logger.warning(
                "%s: download %s ended early: %s",
                self.server.task,
                request.path,
                "the peer stopped reading" if isinstance(exc, TimeoutError) else exc,
            )
            if request.transport is not None:
                request.transport.close()
        return response

    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        server = self.server
        if request.path == "/metrics" and server.metrics_public:
            return await handler(request)
        if request.match_info.route in self._pages:  # a page checks its requests itself
            return await handler(request)
        if len(request.headers.getall("Authorization", ())) > 1:  # which would count?
            return self._json_error(InvalidArgumentError("Authorization given more than once"), 400)
        if not bearer_ok(request.headers.get("Authorization"), server.token_bytes):
            return self._json_error(
                AuthenticationError("missing or wrong cluster token: send 'Authorization: Bearer <token>'"),
                401,
            )
        if request.transport is not None and self.authenticated is not None:
            self.authenticated(request.transport)  # past the token: no pre-auth deadline
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            return self._json_error(
                ProtocolError(f"Content-Encoding {encoding!r} is not accepted: send the body as it is"), 415
            )
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(msgspec.structs.asdict(self.server.health(Health())))

    async def _metrics(self, request: web.Request) -> web.Response:
        server = self.server
        if self._registry is None:
            self._registry = make_registry(
                {"role": server.role, "task": str(server.index)}, lambda: server.statistics(None)
            )
        return web.Response(body=render(self._registry), headers={"Content-Type": METRICS_TYPE})

    async def _op(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        op = request.match_info["op"]
        if request.content_type in ("application/json", "application/x-www-form-urlencoded"):
            return self._json_error(
                ProtocolError(
                    f"POST /v1/{op} takes pstrain's wire format ({CONTENT_TYPE}, as pstrain's "
                    f"clients send it), not {request.content_type}"
                ),
                400,
            )
        length = request.content_length
        if length is not None and length > server.max_body:
            return self._json_error(
                ProtocolError(
                    f"request body of {length} bytes is larger than this server's limit of "
                    f"{server.max_body} bytes"
                ),
                413,
            )
        try:
            body = await self._read_body(request, length)
        except web.HTTPRequestEntityTooLarge:
            return self._json_error(
                ProtocolError(f"request body is larger than this server's limit of {server.max_body} bytes"),
                413,
            )
        except ProtocolError as exc:
            return self._json_error(exc)
        pending = server.handle(op, body, None)
        reply = pending if isinstance(pending, Reply) else await pending
        if reply.kind == FrameKind.ERROR:
            return web.Response(
                status=reply.status,
                content_type="application/json",
                text=json.dumps({"error": reply.envelope}),
            )
        try:
            out = b"".join(reply.chunks)
        finally:
            if reply.release is not None:
                reply.release()
        return web.Response(body=out, content_type=CONTENT_TYPE)

    async def _read_body(self, request: web.Request, length: int | None) -> bytes | bytearray:
        """The body, grown as bytes arrive: memory follows what was sent, not what was claimed."""
        limit = self.server.max_body if length is None else length
        body = bytearray()
        async for chunk in request.content.iter_any():
            if len(body) + len(chunk) > limit:
                if length is not None:
                    raise ProtocolError("request body is longer than its Content-Length")
                raise ProtocolError(
                    f"request body is larger than this server's limit of {self.server.max_body} bytes"
                )
            body += chunk
        if length is not None and len(body) != length:
            raise ProtocolError(f"truncated request body: {len(body)} of {length} bytes")
        return body

    def _json_error(self, exc: BaseException, status: int | None = None) -> web.Response:
        retry = getattr(exc, "retry_after_s", None)  # a busy resource says when to ask again
        return web.Response(
            status=status or status_for(exc),
            content_type="application/json",
            text=json.dumps({"error": to_envelope(exc, self.server.task)}),
            headers={"Retry-After": str(max(1, round(retry)))} if retry else None,
        )
