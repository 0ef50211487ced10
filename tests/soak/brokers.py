"""The soak's private brokers: each can crash and come back, and be read back in full.

A delivery is one message as the broker stored it. Re-sent messages are kept (the NATS
stream's duplicate window is a few milliseconds), so the verdict can count them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import nats
import nats.js.errors
from nats.errors import TimeoutError as FetchTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from relay.demo.embedded import EmbeddedNats

STREAM = "SOAK"
SUBJECTS = ["soak.>"]


@dataclass(frozen=True)
class Delivery:
    """One stored message: its id, the event's uid, where it went and when it was stored."""

    id: str
    uid: str
    destination: str
    stored_at: float

    @property
    def aggregate(self) -> str:
        return self.id.rpartition("@")[0]

    @property
    def version(self) -> int:
        return int(self.id.rpartition("@")[2])


class SoakBroker(Protocol):
    name: str
    crash_kind: str  # how `crash` hurts it: a process kill, or a cut-off
    rule: dict[str, str]  # where the outbox's messages go on this broker

    def relay_config(self) -> dict[str, Any]: ...
    async def start(self) -> None: ...
    async def crash(self) -> None: ...
    async def restart(self) -> None: ...
    async def read_all(self) -> list[Delivery]: ...
    def stop(self) -> None: ...


class NatsSoakBroker:
    """A private nats-server with a file-backed stream: kill -9 and restart lose nothing."""

    name = "nats"
    crash_kind = "kill -9 of nats-server, restarted on the same port and store"
    rule = {"destination": "soak.{aggregate_type}"}

    def __init__(self, root: Path) -> None:
        self.server = EmbeddedNats(root / "nats-store")

    def relay_config(self) -> dict[str, Any]:
        return {
            "type": "nats",
            "servers": [self.server.url],
            "ack_timeout": "2s",
            "connect_timeout": "1s",
        }

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)
        nc = await nats.connect(self.server.url, allow_reconnect=False)
        try:
            await nc.jetstream().add_stream(
                StreamConfig(
                    name=STREAM,
                    subjects=SUBJECTS,
                    storage=StorageType.FILE,
                    # The shortest window allowed: re-sent messages are stored, to be counted.
                    duplicate_window=0.1,
                )
            )
        finally:
            await nc.close()

    async def crash(self) -> None:
        await asyncio.to_thread(self.server.kill)

    async def restart(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def read_all(self) -> list[Delivery]:
        nc = await nats.connect(self.server.url, allow_reconnect=False)
        out: list[Delivery] = []
        try:
            js = nc.jetstream()
            total = (await js.stream_info(STREAM)).state.messages
            name = uuid.uuid4().hex
            await js.add_consumer(
                STREAM,
                ConsumerConfig(
                    name=name, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE
                ),
            )
            sub = await js.pull_subscribe_bind(consumer=name, stream=STREAM)
            while len(out) < total:
                try:
                    batch = await sub.fetch(1000, timeout=2)
                except FetchTimeout:
                    break
                for msg in batch:
                    out.append(_delivery(msg.headers or {}, msg.data, msg.subject, msg.metadata))
            await sub.unsubscribe()
        finally:
            await nc.close()
        return out

    async def recent(self, count: int) -> list[tuple[int, Delivery]]:
        """The newest `count` stored messages, with their stream sequences: for LOSE."""
        nc = await nats.connect(self.server.url, allow_reconnect=False)
        try:
            js = nc.jetstream()
            last = (await js.stream_info(STREAM)).state.last_seq
            out = []
            for seq in range(max(last - count + 1, 1), last + 1):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    msg = await js.get_msg(STREAM, seq=seq)
                    stored = msg.time or datetime.now()
                    out.append(
                        (
                            seq,
                            Delivery(
                                id=(msg.headers or {}).get("Nats-Msg-Id", ""),
                                uid=str(json.loads(msg.data or b"{}")["uid"]),
                                destination=msg.subject or "",
                                stored_at=stored.timestamp(),
                            ),
                        )
                    )
            return out
        finally:
            await nc.close()

    async def delete(self, seq: int) -> None:
        """Lose one stored message: the broker acknowledged it, and does not hold it now."""
        nc = await nats.connect(self.server.url, allow_reconnect=False)
        try:
            await nc.jetstream().delete_msg(STREAM, seq)
        finally:
            await nc.close()

    def stop(self) -> None:
        self.server.kill()


def _delivery(headers: dict[str, str], data: bytes, subject: str, metadata: Any) -> Delivery:
    stored: datetime = metadata.timestamp
    return Delivery(
        id=headers.get("Nats-Msg-Id", ""),
        uid=str(json.loads(data)["uid"]),
        destination=subject,
        stored_at=stored.timestamp(),
    )


class KafkaSoakBroker:
    """tansu, the Kafka-protocol broker the tests can run, behind a proxy.

    tansu keeps its log in memory, so a real restart would lose what it stored: its
    "crash" is a cut-off instead (every connection dropped, then silence for a while),
    which is what a crashed broker looks like from the relay's side.
    """

    name = "kafka"
    crash_kind = "every connection to tansu cut, then black-holed"
    rule = {"destination": "soak.{aggregate_type}"}
    topics = ("soak.book", "soak.member")

    def __init__(self, root: Path) -> None:
        from tests.support.kafka_server import TansuServer

        self.server = TansuServer.behind_proxy(root / "tansu.log")

    def relay_config(self) -> dict[str, Any]:
        return {
            "type": "kafka",
            "bootstrap_servers": [self.server.bootstrap],
            "enable_idempotence": False,  # tansu has no idempotent producer
            "ack_timeout": "3s",
            "connect_timeout": "2s",
        }

    async def start(self) -> None:
        from tests.support.kafka_server import create_topic

        await asyncio.to_thread(self.server.start)
        for topic in self.topics:
            await create_topic(self.server.bootstrap, topic, partitions=3)

    async def crash(self) -> None:
        proxy = self.server.proxy
        assert proxy is not None
        proxy.cut()
        proxy.pause()

    async def restart(self) -> None:
        proxy = self.server.proxy
        assert proxy is not None
        proxy.cut()  # whatever queued up while silent is dropped, as by a restart
        proxy.resume()

    async def read_all(self) -> list[Delivery]:
        from tests.support.kafka_server import consume, headers

        out = []
        for topic in self.topics:
            for record in await consume(self.server.bootstrap, topic, timeout=10):
                out.append(
                    Delivery(
                        id=headers(record)["ce_id"],
                        uid=str(json.loads(record.value)["uid"]),
                        destination=f"{topic}/{record.partition}",
                        stored_at=record.timestamp / 1000,
                    )
                )
        return out

    def stop(self) -> None:
        self.server.close()


class RabbitMqSoakBroker:
    """A private RabbitMQ node, durable queues, and a consumer that stamps what it receives.

    RabbitMQ keeps no arrival time and a queue forgets what was consumed, so a consumer
    takes every message as it comes (acknowledging it) and records when; a node killed and
    restarted keeps the persistent messages it had not delivered yet.
    """

    name = "rabbitmq"
    crash_kind = "kill -9 of the RabbitMQ node, restarted on its data"
    rule = {"destination": "soak", "routing_key": "{aggregate_type}"}
    queues = ("soak-book", "soak-member")

    def __init__(self, root: Path) -> None:
        from tests.support.rabbitmq_server import RabbitMqServer

        self.server = RabbitMqServer(root / "rabbitmq")
        self.received: list[tuple[Delivery, bool]] = []
        self._consuming: asyncio.Task[None] | None = None

    def relay_config(self) -> dict[str, Any]:
        return {
            "type": "rabbitmq",
            "url": self.server.url,
            "declare_exchanges": [{"name": "soak", "type": "topic"}],
            "ack_timeout": "3s",
            "connect_timeout": "2s",
        }

    async def start(self) -> None:
        from tests.support.rabbitmq_server import admin

        logging.getLogger("aiormq").setLevel(logging.CRITICAL)  # its reconnect noise, not ours
        await asyncio.to_thread(self.server.start)
        async with admin(self.server.url) as channel:
            await channel.exchange_declare("soak", exchange_type="topic", durable=True)
            for queue in self.queues:
                await channel.queue_declare(queue, durable=True)
                await channel.queue_bind(queue, "soak", routing_key=queue.split("-")[1])
        self._consuming = asyncio.create_task(self._consume())

    async def crash(self) -> None:
        await asyncio.to_thread(self.server.kill)

    async def restart(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def _consume(self) -> None:
        """Take and record every message, reconnecting after the node has crashed."""
        import aiormq

        while True:
            try:
                connection = await aiormq.connect(self.server.url)
            except (OSError, aiormq.exceptions.AMQPError):
                await asyncio.sleep(0.2)
                continue
            try:
                channel = await connection.channel()
                await channel.basic_qos(prefetch_count=500)
                for queue in self.queues:
                    await channel.basic_consume(queue, self._taker(channel, queue))
                await connection.closing
            except (OSError, aiormq.exceptions.AMQPError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    await connection.close()

    def _taker(self, channel: Any, queue: str) -> Any:
        async def take(message: Any) -> None:
            headers = message.header.properties.headers or {}
            delivery = Delivery(
                id=str(message.header.properties.message_id or headers.get("cloudEvents:id")),
                uid=str(json.loads(message.body)["uid"]),
                destination=queue,
                stored_at=time.time(),
            )
            self.received.append((delivery, bool(message.delivery.redelivered)))
            await channel.basic_ack(message.delivery.delivery_tag)

        return take

    async def read_all(self) -> list[Delivery]:
        """Once both queues have stayed empty a moment: what arrived, minus redeliveries to
        this consumer of messages it had already taken (an acknowledgement lost in a crash)."""
        from tests.support.rabbitmq_server import admin

        quiet = 0
        while quiet < 5:
            await asyncio.sleep(0.2)
            async with admin(self.server.url) as channel:
                waiting = 0
                for queue in self.queues:
                    declared = await channel.queue_declare(queue, passive=True)
                    waiting += declared.message_count or 0
            quiet = quiet + 1 if waiting == 0 else 0
        if self._consuming is not None:
            self._consuming.cancel()
            await asyncio.gather(self._consuming, return_exceptions=True)
        out, taken = [], set()
        for delivery, redelivered in self.received:
            key = (delivery.id, delivery.uid)
            if redelivered and key in taken:
                continue
            taken.add(key)
            out.append(delivery)
        return out

    def stop(self) -> None:
        if self._consuming is not None:
            self._consuming.cancel()
        self.server.kill()


class PubSubSoakBroker:
    """A private Pub/Sub emulator behind a proxy, one ordered subscription per topic.

    The emulator keeps nothing across a restart, so its "crash" is a cut-off, as tansu's.
    A pull acks what it reads, so the messages read so far are kept here.
    """

    name = "pubsub"
    crash_kind = "every connection to the emulator cut, then black-holed"
    rule = {"destination": "soak-{aggregate_type}"}
    topics = ("soak-book", "soak-member")

    def __init__(self, root: Path) -> None:
        from tests.support.proxy import TcpProxy
        from tests.support.pubsub_server import PubSubEmulator

        self.server = PubSubEmulator(root / "pubsub-emulator.log")
        self.proxy: TcpProxy | None = None
        self.read: list[Delivery] = []

    def relay_config(self) -> dict[str, Any]:
        from tests.support.pubsub_server import PROJECT

        assert self.proxy is not None
        return {
            "type": "pubsub",
            "project": PROJECT,
            "emulator_host": f"{self.proxy.host}:{self.proxy.port}",
            "ack_timeout": "3s",
            "connect_timeout": "2s",
        }

    async def start(self) -> None:
        from tests.support.proxy import TcpProxy
        from tests.support.pubsub_server import create_topic

        await asyncio.to_thread(self.server.start)
        self.proxy = TcpProxy("127.0.0.1", self.server.port)
        for topic in self.topics:
            await asyncio.to_thread(create_topic, self.server.host, topic, f"{topic}-soak")

    async def crash(self) -> None:
        assert self.proxy is not None
        self.proxy.cut()
        self.proxy.pause()

    async def restart(self) -> None:
        assert self.proxy is not None
        self.proxy.cut()  # whatever queued up while silent is dropped, as by a restart
        self.proxy.resume()

    async def read_all(self) -> list[Delivery]:
        from tests.support.pubsub_server import pull_all_async

        for topic in self.topics:
            for received in await pull_all_async(self.server.host, f"{topic}-soak", 0, 10):
                m = received.message
                self.read.append(
                    Delivery(
                        id=m.attributes["ce-id"],
                        uid=str(json.loads(m.data)["uid"]),
                        destination=topic,
                        stored_at=m.publish_time.timestamp(),
                    )
                )
        return list(self.read)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        self.server.kill()


class RedisSoakBroker:
    """A private redis-server that appends every write to its AOF and fsyncs it before
    answering, so a SIGKILL loses nothing it acknowledged; killed and started again on its
    port. The relay's id sets live in it too, and survive the crash with the streams."""

    name = "redis"
    crash_kind = "redis-server killed (SIGKILL), started again from its append-only file"
    rule = {"destination": "soak.{aggregate_type}"}
    streams = ("soak.book", "soak.member")

    def __init__(self, root: Path) -> None:
        from tests.support.redis_server import RedisServer

        self.server = RedisServer(
            root / "redis", ["--appendonly", "yes", "--appendfsync", "always"]
        )

    def relay_config(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "url": self.server.url,
            "ack_timeout": "3s",
            "connect_timeout": "2s",
        }

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def crash(self) -> None:
        self.server.kill()

    async def restart(self) -> None:
        await asyncio.to_thread(self.server.start)

    async def read_all(self) -> list[Delivery]:
        from tests.support.redis_server import read_stream

        out = []
        for stream in self.streams:
            for entry_id, fields in await read_stream(self.server.url, stream):
                out.append(
                    Delivery(
                        id=fields["ce_id"].decode(),
                        uid=str(json.loads(fields["body"])["uid"]),
                        destination=stream,
                        stored_at=int(entry_id.partition("-")[0]) / 1000,
                    )
                )
        return out

    def stop(self) -> None:
        self.server.kill()


class HttpSoakBroker:
    """A webhook receiver in this process (tests/support/webhook_server.py), every signature
    verified; a crash ends it (requests in flight are cut, connections refused) and a restart
    serves again on the same port. What it answered 2xx is what was delivered."""

    name = "http"
    crash_kind = "the receiver stopped (requests in flight cut), restarted on the same port"
    rule = {"destination": "soak.{aggregate_type}"}

    def __init__(self, root: Path) -> None:
        del root  # it keeps nothing on disk
        from tests.support.net import free_port

        self.port = free_port()
        self.servers: list[Any] = []  # every incarnation, for read_all

    def relay_config(self) -> dict[str, Any]:
        from tests.support.webhook_server import SECRET

        return {
            "type": "http",
            "url": f"http://127.0.0.1:{self.port}/{{destination}}",
            "signing_keys": [SECRET],
            "ack_timeout": "3s",
            "connect_timeout": "2s",
        }

    async def start(self) -> None:
        from tests.support.webhook_server import WebhookServer

        self.servers.append(await WebhookServer(port=self.port).start())

    async def crash(self) -> None:
        await self.servers[-1].close()

    async def restart(self) -> None:
        await self.start()

    async def read_all(self) -> list[Delivery]:
        out = []
        for server in self.servers:
            for request in server.delivered():
                assert request.verified, f"webhook {request.id!r}: its signature does not verify"
                out.append(
                    Delivery(
                        id=request.id,
                        uid=str(json.loads(request.body)["uid"]),
                        destination=request.path.strip("/"),
                        stored_at=request.at,
                    )
                )
        return out

    def stop(self) -> None:
        for server in self.servers:
            server.stop_now()


def make_broker(name: str, root: Path) -> SoakBroker:
    if name == "nats":
        return NatsSoakBroker(root)
    if name == "kafka":
        return KafkaSoakBroker(root)
    if name == "rabbitmq":
        return RabbitMqSoakBroker(root)
    if name == "pubsub":
        return PubSubSoakBroker(root)
    if name == "redis":
        return RedisSoakBroker(root)
    if name == "http":
        return HttpSoakBroker(root)
    raise ValueError(f"no soak broker {name!r} (known: nats, kafka, rabbitmq, pubsub, redis, http)")
