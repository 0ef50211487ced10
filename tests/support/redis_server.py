"""Redis for tests: the machine's server, private servers, and client helpers.

`redis_url` is the machine's Redis (127.0.0.1:6379) when one answers there; tests use unique
stream names on it and delete them (and their dedup sets) afterwards, and never reconfigure
it. Without it (or with RELAY_TEST_EMBEDDED=1) the session starts a private one.

`redis_factory` starts PRIVATE servers from Debian's `redis-server` binary on free ports,
with no persistence (`--save '' --appendonly no`) and whatever else a test needs (a memory
limit, an ACL user, TLS). Outage tests kill and restart those, never the machine's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.support.net import free_port, wait_for_port

MACHINE_URL = "redis://127.0.0.1:6379/0"
FORCE_EMBEDDED = os.environ.get("RELAY_TEST_EMBEDDED") == "1"
BINARY = shutil.which("redis-server") or "/usr/bin/redis-server"
DEDUP_PREFIX = "outbox-relay:dedup:"  # the adapter's default dedup_key_prefix


def redis_reachable(host: str = "127.0.0.1", port: int = 6379, timeout: float = 2.0) -> bool:
    """Whether a Redis answers PING on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(7).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class RedisServer:
    """One private `redis-server`, nothing persisted; `args` are more `--name value` pairs."""

    def __init__(self, directory: Path, args: Sequence[str] = (), port: int | None = None) -> None:
        self.directory = directory
        self.args = list(args)
        self.port = port or free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [
            BINARY,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.directory / f"redis-{self.port}.log"),
            *self.args,
        ]

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        try:
            wait_for_port("127.0.0.1", self.port, timeout, self._process)
        except (RuntimeError, TimeoutError) as exc:
            self.kill()
            log = self.directory / f"redis-{self.port}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(
                f"redis-server did not start on port {self.port} ({exc}):\n{text}"
            ) from exc
        return self

    def kill(self) -> None:
        """SIGKILL: an outage as sudden as a crash, and nothing kept (no persistence)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()


RedisFactory = Callable[..., RedisServer]


@pytest.fixture
def redis_factory() -> Iterator[RedisFactory]:
    """Start private servers: `redis_factory("--maxmemory", "2mb")`; all killed after."""
    started: list[RedisServer] = []
    with tempfile.TemporaryDirectory(prefix="relay-redis-") as tmp:

        def start(*args: str, port: int | None = None) -> RedisServer:
            server = RedisServer(Path(tmp) / str(len(started)), args, port).start()
            started.append(server)
            return server

        try:
            yield start
        finally:
            for server in started:
                server.kill()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis the tests share: the machine's when it answers, else a private one."""
    if not FORCE_EMBEDDED and redis_reachable():
        yield MACHINE_URL
        return
    with tempfile.TemporaryDirectory(prefix="relay-redis-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.kill()


def unique_stream(prefix: str = "test") -> str:
    return f"relay-test:{prefix}:{uuid.uuid4().hex[:12]}"


@contextlib.asynccontextmanager
async def redis_client(url: str, **options: Any) -> AsyncIterator[aioredis.Redis]:
    """A plain redis-py client for the test's own calls (read, delete, configure)."""
    client = aioredis.Redis.from_url(url, **options)
    try:
        yield client
    finally:
        await client.aclose()


Entry = tuple[str, dict[str, bytes]]


async def read_stream(url: str, stream: str) -> list[Entry]:
    """Every entry of `stream` in order, as a consumer's XRANGE reads them: (id, fields)."""
    entries: list[Entry] = []
    start = "-"
    async with redis_client(url, socket_timeout=60) as client:
        while True:  # in pages: a soak's stream holds tens of thousands
            page: list[tuple[bytes, dict[bytes, bytes]]] = await client.xrange(  # type: ignore[assignment]
                stream, min=start, count=5000
            )
            entries += [(i.decode(), {k.decode(): v for k, v in f.items()}) for i, f in page]
            if len(page) < 5000:
                return entries
            start = "(" + entries[-1][0]


async def delete_stream(url: str, stream: str, prefix: str = DEDUP_PREFIX) -> None:
    """The stream and its dedup set; the server may be gone already."""
    with contextlib.suppress(Exception):
        async with redis_client(url, socket_connect_timeout=2, socket_timeout=2) as client:
            await client.delete(stream, prefix + stream)
