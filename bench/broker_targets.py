"""The brokers `brokers_bench.py` measures: each one's destination, relay config and raw client.

Also the RabbitMQ adapter alone against raw aio-pika (`brokers_bench.py --rabbitmq-adapter`):
the adapter's own overhead, with no Postgres in the way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

import aio_pika
import aioboto3
import aiohttp
import aiormq
import grpc
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from botocore.config import Config
from google.cloud.pubsub_v1 import PublisherClient
from google.cloud.pubsub_v1.types import BatchSettings, PublisherOptions
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from pydantic import SecretStr
from redis.asyncio import Redis as RedisClient

from bench import backlog, report
from bench.measure import ceiling, timed_publish
from relay.brokers._aws import CONCURRENCY, deduplication_id, group_id, message_attributes
from relay.brokers.http import HttpPublisher
from relay.brokers.kafka import message_headers as kafka_headers
from relay.brokers.kinesis import MAX_RECORDS as KINESIS_MAX_RECORDS
from relay.brokers.kinesis import partition_key, record_data
from relay.brokers.pubsub import message_attributes as pubsub_attributes
from relay.brokers.pubsub import ordering_key
from relay.brokers.rabbitmq import RabbitMqPublisher, routing_key
from relay.brokers.redis import BODY_FIELD
from relay.brokers.sqs import SqsPublisher
from relay.config import HttpBrokerConfig, PubSubBrokerConfig, RabbitMqBrokerConfig, RelayConfig
from relay.core.publishing import Message, cloudevent_attributes
from tests.contract.brokers.kinesis import StreamReader
from tests.support import kafka_server, pubsub_server, redis_server, sqs_server
from tests.support.net import free_port, wait_for_port
from tests.support.webhook_server import SECRET

MAX_ENTRIES = SqsPublisher.spec.max_entries  # entries per batch call, as the adapter sends

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
PARTITIONS = 3
MIB = 1024 * 1024


async def quietly(what: str, action: Callable[..., Awaitable[object]], *args: Any) -> None:
    """A clean-up step: a failure is reported, and the other steps still run."""
    try:
        await action(*args)
    except Exception as exc:  # noqa: BLE001 - clean-up reports and goes on
        report.say(f"  warning: could not {what}: {exc!r}")


class Target(Protocol):
    """One broker: its destination, the relay's broker config, and its raw client."""

    label: str  # what the raw client does, for the table
    references: dict[str, float]

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        """Start what is private, create the destination named after `name`; the server's
        version. Everything created is registered on `stack` for removal."""

    def broker(self) -> dict[str, Any] | None:
        """The relay's broker config (None: relay_bench's NATS default)."""

    def destination(self) -> str | None:
        """The relay's destination template (None: relay_bench's NATS default)."""

    async def before_relay(self) -> None:
        """Make the destination ready to count the relay's messages."""

    async def stored(self, expected: int) -> int:
        """Messages the relay stored (waiting up to a few seconds for `expected`)."""

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        """The raw client on the same messages; `tag` is "1" (before) or "2" (after)."""


def rate_of(t: report.Throughput, unit: str = "msg") -> str:
    return (
        f"{t.rate:,.0f} {unit}s/s ({t.count:,} in {t.seconds:.2f}s, "
        f"{t.cpu_us_per_msg:.1f} µs CPU/{unit}, {t.stored:,} stored)"
    )


# -- NATS: the machine's server; the raw client is relay_bench's publish_async reference --------


class Nats:
    label = "nats-py `js.publish_async` x500, then every PubAck (relay_bench's reference)"

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = ""
        self.references: dict[str, float] = {}

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        self.name = name
        version = await backlog.create_stream(self.url, name)
        stack.push_async_callback(
            quietly, f"delete stream {name}", backlog.delete_stream, self.url, name
        )
        return f"nats-server {version}"

    def broker(self) -> dict[str, Any] | None:
        return None

    def destination(self) -> str | None:
        return None

    async def before_relay(self) -> None:
        await backlog.purge_stream(self.url, self.name)

    async def stored(self, expected: int) -> int:
        return await backlog.stored_messages(self.url, self.name)

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        """The `publish_async` reference, relay_bench's headline denominator: the client
        sending the way the relay's publisher does. The `js.publish` ceiling goes to the
        references, for information. Mirror order, as in relay_bench: ceiling, reference |
        relay | reference, ceiling."""
        result: report.Throughput | None = None
        for pipelined in (False, True) if tag == "1" else (True, False):
            t = await ceiling(
                config,
                self.url,
                last,
                batch,
                f"{'p' if pipelined else 'c'}{tag}",
                pipelined=pipelined,
            )
            if pipelined:
                result = t
            else:
                label = f"`js.publish` x{batch} gathered (the ceiling, for information), run {tag}"
                self.references[label] = t.rate
                report.say(f"  ceiling {tag}, js.publish gathered (for information): {rate_of(t)}")
        assert result is not None
        return result


# -- Kafka: a private tansu broker -------------------------------------------------------------


class Kafka:
    label = "aiokafka `send()` x500, then every future; acks=all, no idempotence"

    def __init__(self) -> None:
        self.server: kafka_server.TansuServer | None = None
        self.topic = ""
        self.references: dict[str, float] = {}
        self._offsets: dict[int, int] = {}  # partition -> next offset not yet counted

    @property
    def bootstrap(self) -> str:
        assert self.server is not None
        return self.server.bootstrap

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tansu-")))
        self.server = kafka_server.TansuServer(logs / "tansu.log")
        stack.callback(self.server.close)
        await asyncio.to_thread(self.server.start)
        self.topic = name
        await kafka_server.create_topic(self.bootstrap, name, partitions=PARTITIONS)
        stack.push_async_callback(quietly, f"delete topic {name}", self._delete_topic)
        return await asyncio.to_thread(kafka_server.version)

    async def _delete_topic(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10_000)
        await admin.start()
        try:
            await admin.delete_topics([self.topic])
        finally:
            await admin.close()

    def broker(self) -> dict[str, Any] | None:
        # tansu has no InitProducerId, so no idempotent producer (as in the tests).
        return {"type": "kafka", "bootstrap_servers": [self.bootstrap], "enable_idempotence": False}

    def destination(self) -> str | None:
        return self.topic

    async def before_relay(self) -> None:
        pass  # counted from the offsets reached by the last count

    async def stored(self, expected: int) -> int:
        """Records appended since the last count, read back with a consumer.

        Not from the end offsets: tansu 0.6 reports the base offset of a partition's last
        record batch, plus one, as its end, so those undercount.
        """
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, request_timeout_ms=10_000
        )
        await consumer.start()
        count = 0
        try:
            partitions = [TopicPartition(self.topic, p) for p in range(PARTITIONS)]
            consumer.assign(partitions)
            for tp in partitions:
                consumer.seek(tp, self._offsets.get(tp.partition, 0))
            deadline = time.monotonic() + 30
            while True:
                batches = await consumer.getmany(timeout_ms=300, max_records=10_000)
                for tp, records in batches.items():
                    count += len(records)
                    self._offsets[tp.partition] = records[-1].offset + 1
                if not batches and (count >= expected or time.monotonic() > deadline):
                    return count
        finally:
            await consumer.stop()

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        # The adapter's producer settings (relay/brokers/kafka.py, _new_producer).
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id="bench-raw",
            acks="all",
            enable_idempotence=False,
            max_request_size=MIB,
            max_batch_size=MIB,
            linger_ms=0,
            request_timeout_ms=30_000,
        )
        await producer.start()
        KafkaChunk = list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]]

        def prepare(messages: list[Message]) -> KafkaChunk:
            return [(m.destination, m.key.encode(), m.body, kafka_headers(m)) for m in messages]

        async def send(chunk: KafkaChunk) -> None:
            futures = [
                await producer.send(topic, value=body, key=key, headers=headers)
                for topic, key, body, headers in chunk
            ]
            await asyncio.gather(*futures)

        try:
            await producer.partitions_for(self.topic)  # metadata fetched outside the timer
            result = await timed_publish(config, last, batch, prepare, send)
        finally:
            await producer.stop()
        result.stored = await self.stored(result.count)
        return result


# -- RabbitMQ: the machine's server ------------------------------------------------------------


class RabbitMq:
    label = "aio-pika `exchange.publish` x500 gathered, confirms, mandatory, persistent"

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = ""
        self.references: dict[str, float] = {}
        self._channel: aiormq.abc.AbstractChannel | None = None

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        self.name = name
        admin = await aiormq.connect(self.url)
        stack.push_async_callback(quietly, "close the connection", admin.close)
        self._channel = channel = await admin.channel()
        await channel.exchange_declare(name, exchange_type="topic", durable=True)
        stack.push_async_callback(quietly, f"delete exchange {name}", channel.exchange_delete, name)
        await channel.queue_declare(name, durable=True)
        stack.push_async_callback(quietly, f"delete queue {name}", channel.queue_delete, name)
        await channel.queue_bind(name, name, routing_key="#")
        version = admin.server_properties.get("version", "?")
        return f"RabbitMQ {version.decode() if isinstance(version, bytes) else version}"

    def broker(self) -> dict[str, Any] | None:
        return {"type": "rabbitmq", "url": self.url}

    def destination(self) -> str | None:
        return self.name  # the exchange; routing key: the message type

    async def before_relay(self) -> None:
        assert self._channel is not None
        await self._channel.queue_purge(self.name)

    async def stored(self, expected: int) -> int:
        assert self._channel is not None
        declared = await self._channel.queue_declare(self.name, passive=True)
        return int(declared.message_count or 0)

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        await self.before_relay()  # purge
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.get_exchange(self.name, ensure=False)
            AmqpChunk = list[tuple[aio_pika.Message, str]]

            def prepare(messages: list[Message]) -> AmqpChunk:
                return [(amqp_message(m), routing_key(m)) for m in messages]

            async def send(chunk: AmqpChunk) -> None:
                await asyncio.gather(
                    *(exchange.publish(m, routing_key=key, mandatory=True) for m, key in chunk)
                )

            result = await timed_publish(config, last, batch, prepare, send)
        finally:
            await connection.close()
        result.stored = await self.stored(result.count)
        return result


# -- SQS: a private moto server ----------------------------------------------------------------


@contextlib.contextmanager
def fake_aws_environment() -> Iterator[None]:
    """tests/support/sqs_server's fake credentials, for this process (the relay and the raw
    client find them through the standard chain); the environment is restored afterwards."""
    names = [*sqs_server.FAKE_ENV, *sqs_server.UNSET_ENV]
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(sqs_server.FAKE_ENV)
    for name in sqs_server.UNSET_ENV:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Sqs:
    label = f"aioboto3 `send_message_batch` x{MAX_ENTRIES}, {CONCURRENCY} calls in flight"
    service = "sqs"  # the raw phase's client
    body_field = "MessageBody"  # of a batch entry

    def __init__(self) -> None:
        self.server: sqs_server.MotoServer | None = None
        self.name = ""
        self.references: dict[str, float] = {}
        self._client: Any = None
        self._urls: dict[str, str] = {}  # queue name -> URL

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        stack.enter_context(fake_aws_environment())
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-moto-")))
        self.server = sqs_server.MotoServer(logs / "moto.log")
        stack.callback(self.server.kill)
        await asyncio.to_thread(self.server.start)
        self._client = await stack.enter_async_context(
            aioboto3.Session(region_name=sqs_server.REGION).client(
                "sqs", endpoint_url=self.server.url
            )
        )
        stack.push_async_callback(quietly, "delete the SQS queues", self._delete_queues)
        self.name = name
        await self._queue(self.queue_name("relay"))
        return f"moto {metadata.version('moto')} (SQS API mock)"

    def queue_name(self, phase: str) -> str:
        return f"{self.name}-{phase}.fifo"

    async def _queue(self, name: str) -> str:
        """A fresh FIFO queue. Each phase gets its own: moto's cost per message grows with
        the messages already in the queue, and it purges a queue at most once a minute."""
        self._urls[name] = await sqs_server.create_queue(self._client, name)
        return self._urls[name]

    async def _delete_queues(self) -> None:
        for url in self._urls.values():
            await self._client.delete_queue(QueueUrl=url)

    def broker(self) -> dict[str, Any] | None:
        assert self.server is not None
        return {"type": "sqs", "region": sqs_server.REGION, "endpoint_url": self.server.url}

    def destination(self) -> str | None:
        return self.queue_name("relay")

    async def before_relay(self) -> None:
        pass  # the relay's queue is fresh

    async def stored(self, expected: int, queue: str | None = None) -> int:
        url = self._urls[queue or self.queue_name("relay")]
        response = await self._client.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"]
        )
        return int(response["Attributes"]["ApproximateNumberOfMessages"])

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        """The service's batch call as the adapter makes it (its client settings, FIFO ids,
        MAX_ENTRIES a call, CONCURRENCY calls in flight), without the relay around it."""
        assert self.server is not None
        name = self.queue_name(f"raw{tag}")
        target = await self._raw_target(name)
        slots = asyncio.Semaphore(CONCURRENCY)
        client_config = Config(  # the adapter's client settings (relay/brokers/_aws.py)
            retries={"mode": "standard", "total_max_attempts": 2},
            max_pool_connections=CONCURRENCY,
        )
        Chunk = list[list[dict[str, Any]]]

        def prepare(messages: list[Message]) -> Chunk:
            entries = [
                {
                    "Id": str(i),
                    self.body_field: m.body.decode(),
                    "MessageAttributes": message_attributes(m),
                    "MessageGroupId": group_id(m.key),
                    "MessageDeduplicationId": deduplication_id(m.id),
                }
                for i, m in enumerate(messages)
            ]
            return [entries[i : i + MAX_ENTRIES] for i in range(0, len(entries), MAX_ENTRIES)]

        session = aioboto3.Session(region_name=sqs_server.REGION)
        async with session.client(
            self.service, endpoint_url=self.server.url, config=client_config
        ) as c:

            async def call(entries: list[dict[str, Any]]) -> None:
                async with slots:
                    response = await self._batch_call(c, target, entries)
                if response.get("Failed") or len(response["Successful"]) != len(entries):
                    failed = response.get("Failed", [])[:3]
                    raise RuntimeError(f"{self.service.upper()} refused entries: {failed}")

            async def send(chunk: Chunk) -> None:
                await asyncio.gather(*(call(entries) for entries in chunk))

            await self._warm_up(c, target)  # connection opened outside the timer
            result = await timed_publish(config, last, batch, prepare, send)
        result.stored = await self.stored(result.count, name)
        return result

    async def _raw_target(self, name: str) -> str:
        """A fresh queue for a raw phase: its URL."""
        return await self._queue(name)

    async def _batch_call(self, client: Any, url: str, entries: list[dict[str, Any]]) -> Any:
        return await client.send_message_batch(QueueUrl=url, Entries=entries)

    async def _warm_up(self, client: Any, url: str) -> None:
        await client.get_queue_attributes(QueueUrl=url)


# -- Google Pub/Sub: a private emulator ---------------------------------------------------------


class PubSub:
    label = (
        "google-cloud-pubsub `PublisherClient.publish` x500 with ordering keys, then every"
        " future (the adapter's client settings)"
    )

    def __init__(self) -> None:
        self.server: pubsub_server.PubSubEmulator | None = None
        self.name = ""
        self.references: dict[str, float] = {}
        self._topics: list[tuple[str, str]] = []

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pubsub-")))
        self.server = pubsub_server.PubSubEmulator(logs / "emulator.log")
        stack.callback(self.server.kill)
        await asyncio.to_thread(self.server.start)
        self.name = name.replace("_", "-")
        await self._topic("relay")
        return "Pub/Sub emulator (google-cloud-sdk), on OpenJDK"

    def topic_name(self, phase: str) -> str:
        return f"{self.name}-{phase}"

    async def _topic(self, phase: str) -> str:
        """A fresh topic and subscription per phase: each phase's messages counted alone."""
        assert self.server is not None
        topic = self.topic_name(phase)
        await asyncio.to_thread(pubsub_server.create_topic, self.server.host, topic, topic + "-r")
        self._topics.append((topic, topic + "-r"))
        return topic

    def broker(self) -> dict[str, Any] | None:
        assert self.server is not None
        return {
            "type": "pubsub",
            "project": pubsub_server.PROJECT,
            "emulator_host": self.server.host,
        }

    def destination(self) -> str | None:
        return self.topic_name("relay")

    async def before_relay(self) -> None:
        pass  # the relay's topic is fresh

    async def stored(self, expected: int, topic: str | None = None) -> int:
        assert self.server is not None
        subscription = (topic or self.topic_name("relay")) + "-r"
        pulled = await pubsub_server.pull_all_async(
            self.server.host, subscription, expected, timeout=60
        )
        return len(pulled)

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        assert self.server is not None
        topic = await self._topic(f"raw{tag}")
        path = pubsub_server.topic_path(topic)
        settings = PubSubBrokerConfig(
            type="pubsub", project=pubsub_server.PROJECT, emulator_host=self.server.host
        )
        channel = grpc.insecure_channel(self.server.host)
        client = PublisherClient(  # the adapter's settings (relay/brokers/pubsub.py, connect)
            batch_settings=BatchSettings(
                max_bytes=settings.max_bytes,
                max_latency=settings.max_latency,
                max_messages=settings.max_messages,
            ),
            publisher_options=PublisherOptions(enable_message_ordering=True),
            transport=PublisherGrpcTransport(channel=channel),
        )
        Prepared = list[tuple[bytes, str, dict[str, str]]]

        def prepare(messages: list[Message]) -> Prepared:
            return [(m.body, ordering_key(m.key), pubsub_attributes(m)) for m in messages]

        async def send(chunk: Prepared) -> None:
            futures = [
                client.publish(path, data, ordering_key=key, retry=None, timeout=30, **attributes)
                for data, key, attributes in chunk
            ]
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

        try:
            await asyncio.to_thread(grpc.channel_ready_future(channel).result, 10)
            result = await timed_publish(config, last, batch, prepare, send)
        finally:
            channel.close()
        result.stored = await self.stored(result.count, topic)
        return result


# -- Redis Streams: a private redis-server -----------------------------------------------------


class Redis:
    label = "redis-py pipeline of XADD x500 (no transaction), one round trip, no dedup"

    def __init__(self) -> None:
        self.server: redis_server.RedisServer | None = None
        self.name = ""
        self.references: dict[str, float] = {}
        self._client: RedisClient | None = None

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-redis-")))
        self.server = redis_server.RedisServer(directory)
        stack.callback(self.server.kill)
        await asyncio.to_thread(self.server.start)
        self._client = RedisClient.from_url(self.server.url)
        stack.push_async_callback(self._client.aclose)
        self.name = name
        info = await self._client.info("server")
        return f"redis-server {info['redis_version']} (private, no persistence)"

    def broker(self) -> dict[str, Any] | None:
        assert self.server is not None
        return {"type": "redis", "url": self.server.url}

    def destination(self) -> str | None:
        return f"{self.name}:relay"

    async def before_relay(self) -> None:
        pass  # the relay's stream is its own

    async def stored(self, expected: int, stream: str | None = None) -> int:
        assert self._client is not None
        return int(await self._client.xlen(stream or f"{self.name}:relay"))

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        """The same fields the adapter writes, XADD per message in one pipeline per batch:
        the cheapest way redis-py sends a batch in order, without the relay's id set."""
        assert self.server is not None
        stream = f"{self.name}:raw{tag}"
        client = RedisClient.from_url(self.server.url)

        def prepare(messages: list[Message]) -> list[dict[str | bytes, str | bytes]]:
            entries: list[dict[str | bytes, str | bytes]] = []
            for m in messages:
                fields: dict[str | bytes, str | bytes] = {}
                fields.update(cloudevent_attributes(m, "ce_"))
                fields["content-type"] = m.content_type
                fields[BODY_FIELD] = m.body
                entries.append(fields)
            return entries

        async def send(entries: list[dict[str | bytes, str | bytes]]) -> None:
            pipe = client.pipeline(transaction=False)
            for fields in entries:
                pipe.xadd(stream, fields)  # type: ignore[arg-type]
            await pipe.execute()

        try:
            await client.ping()  # connection opened outside the timer
            result = await timed_publish(config, last, batch, prepare, send)
        finally:
            await client.aclose()
        result.stored = await self.stored(result.count, stream)
        return result


# -- Webhooks: a bare receiver in a process of its own ------------------------------------------

HTTP_IN_FLIGHT = 16  # the adapter's default max_in_flight


class Http:
    label = (
        f"aiohttp `session.post` per message, {HTTP_IN_FLIGHT} in flight, signed (Standard"
        " Webhooks), one key at a time"
    )

    def __init__(self) -> None:
        self.port = 0
        self.references: dict[str, float] = {}
        self._process: asyncio.subprocess.Process | None = None

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        del name  # one receiver per run: each phase posts to a path of its own
        self.port = free_port()
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.support.webhook_server", str(self.port)
        )
        stack.push_async_callback(quietly, "stop the webhook receiver", self._stop)
        await asyncio.to_thread(wait_for_port, "127.0.0.1", self.port, 15)
        return f"aiohttp.web {metadata.version('aiohttp')} (a receiver answering 204)"

    async def _stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()

    def _config(self) -> dict[str, Any]:
        return {
            "type": "http",
            "url": f"http://127.0.0.1:{self.port}/{{destination}}",
            "signing_keys": [SECRET],
            "max_in_flight": HTTP_IN_FLIGHT,
        }

    def broker(self) -> dict[str, Any] | None:
        return self._config()

    def destination(self) -> str | None:
        return "relay"

    async def before_relay(self) -> None:
        pass  # the relay posts to a path of its own

    async def stored(self, expected: int, phase: str = "relay") -> int:
        del expected
        url = f"http://127.0.0.1:{self.port}/count/{phase}"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return int(await response.text())

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        """The same POSTs, headers made by the adapter's own helper outside the timer; each
        key's messages one after the other, as the adapter promises."""
        phase = f"raw{tag}"
        signer = HttpPublisher("raw", HttpBrokerConfig.model_validate(self._config()))
        url = f"http://127.0.0.1:{self.port}/{phase}"
        Prepared = list[list[tuple[bytes, dict[str, str]]]]

        def prepare(messages: list[Message]) -> Prepared:
            by_key: dict[str, list[tuple[bytes, dict[str, str]]]] = {}
            for m in messages:
                by_key.setdefault(m.key, []).append((m.body, signer.headers(m)))
            return list(by_key.values())

        connector = aiohttp.TCPConnector(limit=HTTP_IN_FLIGHT)
        slots = asyncio.Semaphore(HTTP_IN_FLIGHT)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one_key(posts: list[tuple[bytes, dict[str, str]]]) -> None:
                for body, headers in posts:
                    async with slots, session.post(url, data=body, headers=headers) as response:
                        if response.status >= 300:
                            raise RuntimeError(f"the receiver answered {response.status}")

            async def send(keys: Prepared) -> None:
                await asyncio.gather(*(one_key(posts) for posts in keys))

            async with session.get(f"http://127.0.0.1:{self.port}/count/{phase}"):
                pass  # a connection opened outside the timer
            result = await timed_publish(config, last, batch, prepare, send)
        result.stored = await self.stored(result.count, phase)
        return result


# -- SNS: a FIFO topic per phase, each with a FIFO queue subscribed (raw delivery) -------------


class Sns(Sqs):
    """The same private moto server as SQS. What a phase stored is counted in the queue
    subscribed to its topic: moto's SNS delivers into SQS inside the publish call."""

    label = f"aioboto3 `publish_batch` x{MAX_ENTRIES}, {CONCURRENCY} calls in flight"
    service = "sns"
    body_field = "Message"

    def __init__(self) -> None:
        super().__init__()
        self._topics: dict[str, str] = {}  # queue name -> the ARN of the topic feeding it
        self._sns: Any = None

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        self.name = name
        stack.enter_context(fake_aws_environment())
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-moto-")))
        self.server = sqs_server.MotoServer(logs / "moto.log")
        stack.callback(self.server.kill)
        await asyncio.to_thread(self.server.start)
        session = aioboto3.Session(region_name=sqs_server.REGION)
        self._client = await stack.enter_async_context(
            session.client("sqs", endpoint_url=self.server.url)
        )
        self._sns = await stack.enter_async_context(
            session.client("sns", endpoint_url=self.server.url)
        )
        stack.push_async_callback(quietly, "delete the SQS queues", self._delete_queues)
        await self._queue(self.queue_name("relay"))
        return f"moto {metadata.version('moto')} (SNS and SQS API mock)"

    async def _queue(self, name: str) -> str:
        """A fresh FIFO topic, and a FIFO queue subscribed to it with raw delivery."""
        url = await super()._queue(name)
        attributes = await self._client.get_queue_attributes(
            QueueUrl=url, AttributeNames=["QueueArn"]
        )
        topic = await self._sns.create_topic(Name=name, Attributes={"FifoTopic": "true"})
        self._topics[name] = topic["TopicArn"]
        await self._sns.subscribe(
            TopicArn=topic["TopicArn"],
            Protocol="sqs",
            Endpoint=attributes["Attributes"]["QueueArn"],
            Attributes={"RawMessageDelivery": "true"},
        )
        return url

    async def _delete_queues(self) -> None:
        for arn in self._topics.values():
            await self._sns.delete_topic(TopicArn=arn)
        await super()._delete_queues()

    def broker(self) -> dict[str, Any] | None:
        assert self.server is not None
        return {"type": "sns", "region": sqs_server.REGION, "endpoint_url": self.server.url}

    def destination(self) -> str | None:
        return self._topics[self.queue_name("relay")]

    async def _raw_target(self, name: str) -> str:
        """A fresh topic (and its queue) for a raw phase: the topic's ARN."""
        await self._queue(name)
        return self._topics[name]

    async def _batch_call(self, client: Any, arn: str, entries: list[dict[str, Any]]) -> Any:
        return await client.publish_batch(TopicArn=arn, PublishBatchRequestEntries=entries)

    async def _warm_up(self, client: Any, arn: str) -> None:
        await client.get_topic_attributes(TopicArn=arn)


# -- Kinesis: a stream per phase on the same private moto server -------------------------------


class Kinesis(Sqs):
    """A 4-shard stream per phase; what a phase stored is counted by reading every shard."""

    label = f"aioboto3 `put_records` x{KINESIS_MAX_RECORDS}, one call at a time"

    def __init__(self) -> None:
        super().__init__()
        self._streams: list[str] = []

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        self.name = name
        stack.enter_context(fake_aws_environment())
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-moto-")))
        self.server = sqs_server.MotoServer(logs / "moto.log")
        stack.callback(self.server.kill)
        await asyncio.to_thread(self.server.start)
        self._client = await stack.enter_async_context(
            aioboto3.Session(region_name=sqs_server.REGION).client(
                "kinesis", endpoint_url=self.server.url
            )
        )
        stack.push_async_callback(quietly, "delete the Kinesis streams", self._delete_streams)
        await self._stream(self.stream_name("relay"))
        return f"moto {metadata.version('moto')} (Kinesis API mock)"

    def stream_name(self, phase: str) -> str:
        return f"{self.name}-{phase}"

    async def _stream(self, name: str) -> str:
        await self._client.create_stream(StreamName=name, ShardCount=4)
        self._streams.append(name)
        return name

    async def _delete_streams(self) -> None:
        for name in self._streams:
            await self._client.delete_stream(StreamName=name)

    def broker(self) -> dict[str, Any] | None:
        assert self.server is not None
        return {"type": "kinesis", "region": sqs_server.REGION, "endpoint_url": self.server.url}

    def destination(self) -> str | None:
        return self.stream_name("relay")

    async def stored(self, expected: int, queue: str | None = None) -> int:
        reader = StreamReader(self._client, queue or self.stream_name("relay"))
        records = await reader.read(expected, timeout=10)
        return len({r["Data"] for r in records})

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> report.Throughput:
        assert self.server is not None
        name = await self._stream(self.stream_name(f"raw{tag}"))
        client_config = Config(  # the adapter's client settings (relay/brokers/_aws.py)
            retries={"mode": "standard", "total_max_attempts": 2},
            max_pool_connections=CONCURRENCY,
        )
        Calls = list[list[dict[str, Any]]]

        def prepare(messages: list[Message]) -> Calls:
            records = [
                {"Data": record_data(m), "PartitionKey": partition_key(m.key)} for m in messages
            ]
            step = KINESIS_MAX_RECORDS
            return [records[i : i + step] for i in range(0, len(records), step)]

        session = aioboto3.Session(region_name=sqs_server.REGION)
        async with session.client(
            "kinesis", endpoint_url=self.server.url, config=client_config
        ) as c:

            async def send(calls: Calls) -> None:
                for records in calls:
                    response = await c.put_records(StreamName=name, Records=records)
                    if response.get("FailedRecordCount"):
                        raise RuntimeError(f"Kinesis failed {response['FailedRecordCount']}")

            await c.describe_stream_summary(StreamName=name)  # connected outside the timer
            result = await timed_publish(config, last, batch, prepare, send)
        result.stored = await self.stored(result.count, name)
        return result


# -- the run -----------------------------------------------------------------------------------


# -- the RabbitMQ adapter alone, against raw aio-pika -----------------------------------------

N, BATCH = 20_000, 500  # the adapter-alone comparison: messages, batch
TYPE = "library.book-lent.v1"


def messages(exchange: str) -> list[Message]:
    time_ = datetime(2026, 11, 29, 8, 30, tzinfo=UTC)
    return [
        Message(
            id=f"book/book-{i % 1000}@{i // 1000 + 1}",
            type=TYPE,
            destination=exchange,
            key=f"book-{i % 1000}",
            body=b'{"bookId":"book-%d","loanId":"loan-%d","memberId":"member-%d","version":%d}'
            % (i % 1000, i, i % 77, i // 1000 + 1),
            source="/outbox-relay/loans",
            time=time_,
            position=i + 1,
        )
        for i in range(N)
    ]


def amqp_message(m: Message) -> aio_pika.Message:
    assert m.time is not None
    return aio_pika.Message(
        m.body,
        content_type=m.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=m.id,
        type=m.type,
        timestamp=m.time,
        app_id="outbox-relay",
        headers={
            "cloudEvents:specversion": "1.0",
            "cloudEvents:id": m.id,
            "cloudEvents:type": m.type,
            "cloudEvents:source": m.source,
            "cloudEvents:partitionkey": m.key,
            "x-deduplication-header": m.id,
            "cloudEvents:time": m.time.isoformat(),
        },
    )


async def relay_publisher(url: str, batch: list[Message]) -> float:
    config = RabbitMqBrokerConfig(type="rabbitmq", url=SecretStr(url), ack_timeout=30)
    publisher = RabbitMqPublisher("bench", config)
    await publisher.connect()
    try:
        started = time.perf_counter()
        for i in range(0, N, BATCH):
            outcomes = await publisher.publish(batch[i : i + BATCH])
            assert not any(outcomes), outcomes
        return time.perf_counter() - started
    finally:
        await publisher.close()


async def raw_aio_pika(url: str, batch: list[Message], prebuilt: bool) -> float:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(batch[0].destination, ensure=False)
        built = [amqp_message(m) for m in batch] if prebuilt else []
        started = time.perf_counter()
        for i in range(0, N, BATCH):
            chunk = (
                built[i : i + BATCH]
                if prebuilt
                else [amqp_message(m) for m in batch[i : i + BATCH]]
            )
            await asyncio.gather(*(exchange.publish(a, routing_key=TYPE) for a in chunk))
        return time.perf_counter() - started
    finally:
        await connection.close()


async def rabbitmq_adapter_rounds(url: str, rounds: int) -> None:
    """The adapter's throughput against raw aio-pika; prints medians and ratios."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin = await aiormq.connect(url)
    channel = await admin.channel()
    results: dict[str, list[float]] = {
        "relay RabbitMqPublisher": [],
        "raw aio-pika, building in the loop": [],
        "raw aio-pika, pre-built": [],
    }
    try:
        await channel.exchange_declare(name, exchange_type="topic", durable=True)
        await channel.queue_declare(name, durable=True)
        await channel.queue_bind(name, name, routing_key="#")
        batch = messages(name)
        for r in range(rounds):
            for label in list(results) if r % 2 == 0 else list(reversed(results)):
                await channel.queue_purge(name)
                if label.startswith("relay"):
                    seconds = await relay_publisher(url, batch)
                else:
                    seconds = await raw_aio_pika(url, batch, prebuilt="pre-built" in label)
                results[label].append(N / seconds)
    finally:
        await channel.queue_delete(name)
        await channel.exchange_delete(name)
        await admin.close()
    for label, rates in results.items():
        runs = ", ".join(f"{x:.0f}" for x in rates)
        print(f"{label:36s} median {statistics.median(rates):7.0f} msg/s   runs: {runs}")
    relay = statistics.median(results["relay RabbitMqPublisher"])
    for label in list(results)[1:]:
        print(f"relay / {label}: {relay / statistics.median(results[label]):.2f}")
