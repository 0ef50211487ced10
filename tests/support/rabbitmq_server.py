"""RabbitMQ for tests: the machine's server, private nodes, and client helpers.

`rabbitmq_url` is the machine's RabbitMQ (127.0.0.1:5672, guest/guest) when one answers there;
tests use unique exchange and queue names on it and delete them afterwards. Without it (or
with RELAY_TEST_EMBEDDED=1) the session starts a private node from Debian's `rabbitmq-server`
package, which `python3 dev.py test` installs when it runs as root (see dev.py).

`rabbitmq_small_url` is a private node whose `max_message_size` is 1 MiB: the only way to see
RabbitMQ reject a message for good without a 128 MiB body or touching the shared server.

A private node is a second Erlang node on the machine: its own name, ports, data directory,
config file and cookie (its HOME is its directory). It registers with the machine's epmd and
leaves the machine's node alone. It starts in about 5 seconds and stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiormq
import pytest

from tests.support.net import free_port, wait_for_port

MACHINE_URL = "amqp://guest:guest@127.0.0.1:5672/"
HOW_TO_INSTALL = (
    "install Debian's rabbitmq-server package (`apt-get install rabbitmq-server`, which "
    "`python3 dev.py test` runs itself as root when nothing listens on port 5672)"
)
# Runs the node as the calling user; /usr/sbin/rabbitmq-server would switch to `rabbitmq`.
SERVER_SCRIPT = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
SMALL_MAX_MESSAGE_SIZE = 1024 * 1024
FORCE_EMBEDDED = os.environ.get("RELAY_TEST_EMBEDDED") == "1"

_PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"


def amqp_reachable(host: str = "127.0.0.1", port: int = 5672, timeout: float = 2.0) -> bool:
    """Whether an AMQP 0-9-1 server answers on host:port (its Connection.Start frame)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_PROTOCOL_HEADER)
            first = sock.recv(1)
    except OSError:
        return False
    return first == b"\x01"  # a method frame


def unique_name(prefix: str = "test") -> str:
    """A unique exchange or queue name."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class RabbitMqServer:
    """A private RabbitMQ node with its own settings (`rabbitmq.conf` lines)."""

    def __init__(self, base_dir: Path, settings: dict[str, str] | None = None) -> None:
        self.base_dir = base_dir
        self.settings = settings or {}
        self.port = free_port()
        self.node = f"relaytest-{uuid.uuid4().hex[:8]}@localhost"
        self.log_path = base_dir / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self, timeout: float = 60.0) -> RabbitMqServer:
        if not SERVER_SCRIPT.is_file():
            raise RuntimeError(f"{SERVER_SCRIPT} not found: is rabbitmq-server installed?")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        config = self.base_dir / "rabbitmq.conf"
        lines = [f"listeners.tcp.local = 127.0.0.1:{self.port}"]
        lines += [f"{key} = {value}" for key, value in self.settings.items()]
        config.write_text("\n".join(lines) + "\n")
        (self.base_dir / "enabled_plugins").write_text("[].\n")
        env = {
            **os.environ,
            "HOME": str(self.base_dir),  # its own Erlang cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_CONFIG_FILE": str(config),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.base_dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base_dir / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.base_dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base_dir / "log"),
            "RABBITMQ_PID_FILE": str(self.base_dir / "node.pid"),
        }
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [str(SERVER_SCRIPT)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.base_dir,
                start_new_session=True,
            )
        try:
            wait_for_port("127.0.0.1", self.port, timeout, self._process)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{exc}\n{self.log_path.read_text(errors='replace')}") from exc
        return self

    def kill(self) -> None:
        """Crash the node: SIGKILL to the start script and the Erlang VM, no goodbye."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the session it was started in
        process.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the start script, which stops the node; SIGKILL to both if it hangs."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the session it was started in
            process.wait()


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """URL of a shared RabbitMQ: the machine's, else a private node started for the session."""
    if not FORCE_EMBEDDED and amqp_reachable():
        yield MACHINE_URL
        return
    if not SERVER_SCRIPT.is_file():
        machine = "" if FORCE_EMBEDDED else "RabbitMQ is not reachable at 127.0.0.1:5672 and "
        pytest.fail(
            f"{machine}{SERVER_SCRIPT} is not there to start a private node: {HOW_TO_INSTALL}, "
            "or run a RabbitMQ on 127.0.0.1:5672 with the user guest/guest"
        )
    with tempfile.TemporaryDirectory(prefix="relay-rabbitmq-") as tmp:
        server = RabbitMqServer(Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture(scope="session")
def rabbitmq_small_url() -> Iterator[str]:
    """URL of a private node that refuses bodies over SMALL_MAX_MESSAGE_SIZE (1 MiB)."""
    if not SERVER_SCRIPT.is_file():
        pytest.fail(
            f"{SERVER_SCRIPT} not found: these tests start a private node; {HOW_TO_INSTALL}"
        )
    with tempfile.TemporaryDirectory(prefix="relay-rabbitmq-small-") as tmp:
        settings = {"max_message_size": str(SMALL_MAX_MESSAGE_SIZE)}
        server = RabbitMqServer(Path(tmp), settings).start()
        try:
            yield server.url
        finally:
            server.stop()


# -- client helpers --------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """A message as read from a queue."""

    body: bytes
    routing_key: str
    properties: Any  # pamqp's Basic.Properties
    redelivered: bool

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.properties.headers or {})


@contextlib.asynccontextmanager
async def admin(url: str) -> AsyncIterator[aiormq.abc.AbstractChannel]:
    """A channel for declaring, binding, reading and deleting (no publisher confirms)."""
    connection = await aiormq.connect(url)
    try:
        yield await connection.channel(publisher_confirms=False)
    finally:
        await connection.close()


async def create_topology(
    url: str, exchange: str, queue: str | None = None, binding: str = "#"
) -> None:
    """A durable topic exchange and, if `queue`, a durable queue bound to it with `binding`."""
    async with admin(url) as channel:
        await channel.exchange_declare(exchange, exchange_type="topic", durable=True)
        if queue is not None:
            await channel.queue_declare(queue, durable=True)
            await channel.queue_bind(queue, exchange, routing_key=binding)


async def create_stream(url: str, stream: str, exchange: str | None, binding: str = "#") -> None:
    """A stream queue (x-queue-type: stream), bound to `exchange` with `binding` if given."""
    async with admin(url) as channel:
        await channel.queue_declare(stream, durable=True, arguments={"x-queue-type": "stream"})
        if exchange is not None:
            await channel.queue_bind(stream, exchange, routing_key=binding)


async def bind(url: str, exchange: str, queue: str, binding: str = "#") -> None:
    async with admin(url) as channel:
        await channel.queue_declare(queue, durable=True)
        await channel.queue_bind(queue, exchange, routing_key=binding)


async def delete_topology(url: str, exchange: str | None, *queues: str) -> None:
    """Delete what a test created; what is already gone is fine."""
    async with admin(url) as channel:
        for queue in queues:
            await channel.queue_delete(queue)
        if exchange:
            await channel.exchange_delete(exchange)


class QueueReader:
    """Takes messages off a queue and keeps all of them, in the order they were delivered."""

    def __init__(self, url: str, queue: str) -> None:
        self.url = url
        self.queue = queue
        self.received: list[Received] = []

    async def fetch(
        self,
        expected: int = 0,
        timeout: float = 30.0,  # noqa: ASYNC109 - one deadline across many polls
    ) -> list[Received]:
        """Everything read so far, waiting until at least `expected` messages have come."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.received += await self._drain()
            if len(self.received) >= expected or loop.time() > deadline:
                return list(self.received)
            await asyncio.sleep(0.1)

    async def _drain(self) -> list[Received]:
        received: list[Received] = []
        async with admin(self.url) as channel:
            while True:
                message = await channel.basic_get(self.queue, no_ack=True)
                if not isinstance(message.delivery, aiormq.spec.Basic.GetOk):
                    return received
                received.append(
                    Received(
                        body=message.body,
                        routing_key=message.delivery.routing_key or "",
                        properties=message.header.properties,
                        redelivered=bool(message.delivery.redelivered),
                    )
                )
