"""The HTTP endpoints: /metrics, /healthz (liveness), /readyz (readiness), and the status
page (`/`, `/status.json`; runtime/status_page.py) unless `http.status_page` is off.

A deliberately tiny HTTP/1.1 server on asyncio streams: a few GET routes do
not justify a web framework dependency.

- /healthz answers 200 while the event loop turns and every relay task is
  alive. It never asks the database, so a database outage does not make
  Kubernetes restart every replica.
- /readyz answers 200 once the config is loaded and the database answered
  recently. A standby is ready: it is part of the deployment's capacity.

A misbehaving client must not exhaust the relay's file descriptors: a connection gets
`request_timeout` to send its request and again to take the response, and past
`max_connections` the oldest connection is closed. The oldest, not the newest, so that
a flood of half-sent requests cannot lock the probes out: a probe sends its request at
once and is answered long before it becomes the oldest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

import structlog

from relay.core.metrics import Metrics
from relay.errors import RelayError
from relay.runtime.status_page import StatusPage

log = structlog.get_logger("relay.runtime.http")
_WARN_EVERY = 60.0  # seconds between two warnings that the connection cap was reached
# Every answer: a page served here may load only from here (no CDN: clusters often have no
# internet), run no inline script, be framed by nobody; no answer is cached or sniffed.
_HEADERS = (
    "Content-Security-Policy: default-src 'self'; base-uri 'none'; form-action 'none';"
    " frame-ancestors 'none'\r\n"
    "X-Content-Type-Options: nosniff\r\n"
    "Referrer-Policy: no-referrer\r\n"
    "Cache-Control: no-store\r\n"
)


@dataclass
class Health:
    """What the probes report; the runner keeps it up to date."""

    tasks_alive: Callable[[], bool]
    database_ok: Callable[[], bool]
    states: Callable[[], dict[str, str]]


@dataclass(eq=False)
class HttpServer:
    """/metrics, /healthz, /readyz and the status page on one port, with a bound on open
    connections."""

    host: str
    port: int
    metrics: Metrics
    health: Health
    _: KW_ONLY
    request_timeout: float = 5.0
    max_connections: int = 64
    status_page: StatusPage | None = None  # None: `http.status_page: false`
    _server: asyncio.Server | None = field(default=None, init=False)
    _open: dict[asyncio.StreamWriter, None] = field(default_factory=dict, init=False)  # by age
    _warned_full: float = field(default=-_WARN_EVERY, init=False)

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        except OSError as exc:
            raise RelayError(
                f"http.port: cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
                " (set http.port, or run with --http-port)"
            ) from exc
        sockets = self._server.sockets or ()
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("http listening", host=self.host, port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._open):
                writer.transport.abort()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= self.max_connections:
            self._close_oldest()
        self._open[writer] = None
        try:
            async with asyncio.timeout(self.request_timeout):
                request = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(request)
            status, content_type, body = await self._route(method, path)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{_HEADERS}"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (body if method != "HEAD" else b"")
            )
            async with asyncio.timeout(self.request_timeout):
                await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            ValueError,
        ):
            pass
        finally:
            self._open.pop(writer, None)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # a reader that stalled: close() would wait for it
            else:
                writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _close_oldest(self) -> None:
        """At the cap: drop the connection that has been open longest (see the module doc)."""
        oldest = next(iter(self._open))
        del self._open[oldest]
        oldest.transport.abort()  # its handler sees the connection lost and ends
        now = time.monotonic()
        if now - self._warned_full >= _WARN_EVERY:
            self._warned_full = now
            log.warning(
                "http: too many open connections, closing the oldest",
                max_connections=self.max_connections,
                request_timeout=self.request_timeout,
            )

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        path = path.split("?", 1)[0]
        if path == "/metrics":
            return "200 OK", "text/plain; version=0.0.4; charset=utf-8", self.metrics.render()
        if path == "/healthz":
            ok = self.health.tasks_alive()
            return _json(ok, {"alive": ok})
        if path == "/readyz":
            ok = self.health.database_ok()
            return _json(ok, {"ready": ok, "database": ok, "outboxes": self.health.states()})
        if self.status_page is not None:
            if path == "/status.json":
                return "200 OK", "application/json", await self.status_page.status_json()
            if (found := self.status_page.file(path)) is not None:
                return "200 OK", *found
        return "404 Not Found", "text/plain", b"not found\n"


def _request_line(request: bytes) -> tuple[str, str]:
    line = request.split(b"\r\n", 1)[0].decode("latin-1")
    method, path, _version = line.split(" ", 2)
    return method, path


def _json(ok: bool, payload: dict[str, object]) -> tuple[str, str, bytes]:
    status = "200 OK" if ok else "503 Service Unavailable"
    return status, "application/json", json.dumps(payload).encode() + b"\n"
