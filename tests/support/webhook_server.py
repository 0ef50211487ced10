"""A webhook receiver for tests: a real HTTP server (aiohttp.web) on a free port of 127.0.0.1.

It answers 204 unless told otherwise, and can fail, stall and answer slowly on purpose:
`plan` gives the next answers for a message id (a status, headers, a body, a delay), `hold`
keeps every request unanswered until `release`. It records every request as it came (headers,
body, the answer it got) and verifies each signature with the `standardwebhooks` package,
as a receiver would. It also notes a request that came while another of the same key was
still being answered: the relay promises never to do that.

`python -m tests.support.webhook_server PORT` runs a bare one in its own process (for the
benchmark): 204 to everything, counted per path at GET /count/<first segment>.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.support.scenario import eventually

SECRET = "whsec_" + base64.b64encode(b"outbox-relay-test-signing-key-1").decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"outbox-relay-test-signing-key-0").decode()


@dataclass(frozen=True)
class Answer:
    """What the receiver answers to one request."""

    status: int = 204
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay: float = 0.0  # seconds before answering: a slow receiver


@dataclass(frozen=True)
class Request:
    """One request as it came, and what it was answered."""

    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    status: int
    verified: bool | None  # the signature checked with the receiver's secret; None: no secret
    at: float = 0.0  # when it was answered (time.time())

    @property
    def id(self) -> str:
        return self.headers.get("webhook-id", "")

    @property
    def key(self) -> str | None:
        """The partition key: a binary-mode header, else the structured event's member."""
        if "ce-partitionkey" in self.headers:
            return self.headers["ce-partitionkey"]
        with contextlib.suppress(ValueError, AttributeError):
            key = json.loads(self.body).get("partitionkey")
            return str(key) if key is not None else None
        return None

    @property
    def delivered(self) -> bool:
        return 200 <= self.status < 300


class WebhookServer:
    """Start with `await WebhookServer().start()`; `close()` at the end."""

    def __init__(
        self,
        *,
        secret: str | None = SECRET,
        max_body: int = 1024**2,
        port: int = 0,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.secret = Webhook(secret) if secret else None
        self.max_body = max_body
        self.requests: list[Request] = []
        self.plan: dict[str, list[Answer]] = {}  # message id -> its next answers, in turn
        self.default = Answer()
        self.stalled = False  # every request waits while it is true (`hold`, `release`)
        self.overlaps: list[str] = []  # ids that came while their key had one in flight
        self.in_flight = 0
        self.most_in_flight = 0
        self._keys: Counter[str] = Counter()
        self._released: asyncio.Event  # the server's loop's own, made in its thread
        self._closing = _ThreadsafeEvent()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.port = port  # 0: a free one, chosen at start
        self.tls = tls  # (certificate, key): serve https

    async def start(self) -> WebhookServer:
        """Serve from a thread with its own event loop: the test's loop keeps only its own
        tasks (the shared kit checks a publisher leaves none behind), and a relay under test
        in this process competes with the receiver no more than with a remote one."""
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        await asyncio.to_thread(ready.wait, 10)
        if not ready.is_set():
            raise RuntimeError("the webhook server did not start")
        return self

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._released = asyncio.Event()
        app = web.Application(client_max_size=self.max_body)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        loop.run_until_complete(runner.setup())
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*self.tls)
        site = web.TCPSite(runner, "127.0.0.1", self.port, ssl_context=context)
        loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        loop.run_until_complete(self._closing.wait())
        loop.run_until_complete(runner.cleanup())
        loop.close()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def delivered(self) -> list[Request]:
        """The requests answered 2xx, in the order they were answered (duplicates too)."""
        return [r for r in self.requests if r.delivered]

    async def wait_delivered(self, expected: int, timeout: float = 30.0) -> list[Request]:  # noqa: ASYNC109
        """Every delivered request, once `expected` distinct messages (ids) have come: a
        re-sent one (its answer lost in an outage) does not stand for one still missing."""

        def all_arrived() -> bool:
            return len({r.id for r in self.delivered()}) >= expected

        try:
            await eventually(all_arrived, timeout, interval=0.02)
        except AssertionError:
            distinct = len({r.id for r in self.delivered()})
            raise AssertionError(
                f"{distinct} of {expected} webhooks delivered within {timeout}s"
                f" ({len(self.requests)} requests)"
            ) from None
        return self.delivered()

    def hold(self) -> None:
        """Stall: every request waits, unanswered, until `release`."""
        self.stalled = True

    def release(self) -> None:
        """End a stall: the requests held are answered."""
        self.stalled = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._released.set)

    def stop_now(self) -> None:
        """`close` for code that is not async (a soak's clean-up); a second call does nothing."""
        thread, self._thread = self._thread, None
        if self._loop is None or thread is None:
            return
        self.release()
        self._loop.call_soon_threadsafe(self._closing.set)
        thread.join(10)

    async def close(self) -> None:
        """Stop serving (requests in flight are cut); a second call does nothing."""
        thread, self._thread = self._thread, None
        if self._loop is None or thread is None:
            return
        self.release()
        self._loop.call_soon_threadsafe(self._closing.set)
        await asyncio.to_thread(thread.join, 10)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        headers = {name.lower(): value for name, value in request.headers.items()}
        key = headers.get("ce-partitionkey") or headers.get("webhook-id", "")
        message_id = headers.get("webhook-id", "")
        if self._keys[key]:
            self.overlaps.append(message_id)
        self._keys[key] += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                self._record(request, headers, b"", exc.status)
                raise
            while self.stalled:
                self._released.clear()
                await self._released.wait()
            planned = self.plan.get(message_id)
            answer = planned.pop(0) if planned else self.default
            if answer.delay:
                await asyncio.sleep(answer.delay)
            self._record(request, headers, body, answer.status)
            return web.Response(status=answer.status, headers=answer.headers, body=answer.body)
        finally:
            self._keys[key] -= 1
            self.in_flight -= 1

    def _record(
        self, request: web.Request, headers: dict[str, str], body: bytes, status: int
    ) -> None:
        verified = None
        if self.secret is not None:
            try:
                self.secret.verify(body, headers, json_parse=False)
                verified = True
            except (WebhookVerificationError, ValueError):
                verified = False
        self.requests.append(Request(request.path, headers, body, status, verified, time.time()))


class _ThreadsafeEvent:
    """An asyncio.Event made lazily in the loop that first waits on it."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self._early = False

    async def wait(self) -> None:
        self._event = asyncio.Event()
        if self._early:
            self._event.set()
        await self._event.wait()

    def set(self) -> None:
        self._early = True
        if self._event is not None:
            self._event.set()


async def _serve_bare(port: int) -> None:
    """204 to every POST, counted by the path's first segment (GET /count/<segment>): the
    benchmark's receiver, one phase per segment."""
    counts: Counter[str] = Counter()

    async def take(request: web.Request) -> web.Response:
        await request.read()
        counts[request.path.strip("/").partition("/")[0]] += 1
        return web.Response(status=204)

    async def counted(request: web.Request) -> web.Response:
        return web.Response(text=str(counts[request.match_info["segment"]]))

    app = web.Application()
    app.router.add_get("/count/{segment}", counted)
    app.router.add_post("/{tail:.*}", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main(argv: list[str]) -> None:
    asyncio.run(_serve_bare(int(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["OLD_SECRET", "SECRET", "Answer", "Request", "WebhookServer", "main"]
