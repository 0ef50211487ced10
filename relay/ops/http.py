"""The HTTP endpoints: /metrics, /healthz (liveness) and /readyz (readiness).

A deliberately tiny HTTP/1.1 server on asyncio streams: three GET routes do
not justify a web framework dependency.

- /healthz answers 200 while the event loop turns and every relay task is
  alive. It never asks the database, so a database outage does not make
  Kubernetes restart every replica.
- /readyz answers 200 once the config is loaded and the database answered
  recently. A standby is ready: it is part of the deployment's capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from relay.core.metrics import Metrics
from relay.errors import RelayError

log = structlog.get_logger("relay.ops.http")


@dataclass
class Health:
    """What the probes report; the runner keeps it up to date."""

    tasks_alive: Callable[[], bool]
    database_ok: Callable[[], bool]
    states: Callable[[], dict[str, str]]


class HttpServer:
    def __init__(self, host: str, port: int, metrics: Metrics, health: Health) -> None:
        self.host = host
        self.port = port
        self.metrics = metrics
        self.health = health
        self._server: asyncio.Server | None = None

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
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                request = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(request)
            status, content_type, body = self._route(method, path)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + (body if method != "HEAD" else b"")
            )
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
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
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
        return "404 Not Found", "text/plain", b"not found\n"


def _request_line(request: bytes) -> tuple[str, str]:
    line = request.split(b"\r\n", 1)[0].decode("latin-1")
    method, path, _version = line.split(" ", 2)
    return method, path


def _json(ok: bool, payload: dict[str, object]) -> tuple[str, str, bytes]:
    status = "200 OK" if ok else "503 Service Unavailable"
    return status, "application/json", json.dumps(payload).encode() + b"\n"
