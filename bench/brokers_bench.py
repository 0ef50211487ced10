"""Outbox Relay benchmark, every broker: backlog drain against the raw client, in one run.

    .venv/bin/python bench/brokers_bench.py [--broker all] [--events 20000] [--sqs-events 500]

For each broker (NATS JetStream, Kafka, RabbitMQ, SQS), one after the other:

1. a fresh database `bench_<hex>` holding the example event table and the relay's schema, with a
   backlog of N BookLent events COPYed in (the same rows as `relay_bench.py`); a fresh
   destination: a file-backed JetStream stream on the machine's NATS; a 3-partition topic on a
   private tansu broker (Kafka protocol, started here); a durable queue bound with `#` to a fresh
   durable topic exchange on the machine's RabbitMQ; a FIFO queue per phase on a private moto
   server (SQS, started here, with fake credentials set in this process's environment; moto gets
   slower as a queue fills, and purges a queue at most once a minute);
   it also times reading and mapping the backlog alone, with nothing sent, for reference;
2. the raw client publishes the relay's own messages (read with the relay's EventSource, mapped
   with its Mapper, converted with the adapter's own header/attribute helpers, all outside the
   timer), `--batch` at a time, with the adapter's acknowledgements and in-flight window:
   - NATS: nats-py `js.publish` x batch gathered, every PubAck awaited (the ceiling of
     `relay_bench.py`); also, for information, `js.publish_async` x batch then every PubAck;
   - Kafka: aiokafka `send()` of the batch's records, then every future awaited; acks=all,
     idempotence off (tansu has no InitProducerId), the adapter's other producer settings;
   - RabbitMQ: aio-pika `exchange.publish` x batch gathered, publisher confirms, mandatory,
     persistent, the adapter's properties and headers;
   - SQS: aioboto3 `send_message_batch` of 10 entries, at most 8 calls in flight (the adapter's
     CONCURRENCY), MessageGroupId = key, MessageDeduplicationId = message id;
3. the real relay (`relay.ops.runner.Relay`, in this process, http off, logging at warning,
   default batch 500 and linger 10 ms) relays the backlog to that broker; it is timed from its
   start until `relay.checkpoints` reaches the last position;
4. the raw client again (mirror order; for NATS: ceiling, reference | relay | reference,
   ceiling, as in `relay_bench.py`), and the ratio relay / mean(raw before, raw after);
5. everything is removed, even on failure: database, stream, topic, exchange and queue, and
   the private tansu and moto servers are stopped.

Every phase checks that the destination then holds exactly N new messages. Prints a Markdown
table at the end. Importing this module adds the repository to `sys.path` (the private servers
come from `tests/support`) and does nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support

import aio_pika
import aioboto3
import aiormq
import asyncpg
import relay_bench as rb
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from botocore.config import Config
from rabbitmq_publisher_bench import amqp_message

from relay.brokers.kafka import _headers as kafka_headers
from relay.brokers.rabbitmq import _routing_key
from relay.brokers.sqs import (
    CONCURRENCY,
    MAX_ENTRIES,
    _attributes,
    _deduplication_id,
    _group_id,
)
from relay.config import RelayConfig
from relay.core.publishing import Message
from relay.ops.commands import migrate
from relay.ops.logs import configure
from tests.support import kafka_server, sqs_server

BROKERS = ("nats", "kafka", "rabbitmq", "sqs")
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
PARTITIONS = 3
MIB = 1024 * 1024


@dataclass
class Row:
    broker: str
    events: int
    server: str = "?"
    load_at_start: str = ""
    relay: rb.Throughput | None = None
    raw_before: rb.Throughput | None = None
    raw_after: rb.Throughput | None = None
    raw_client: str = ""
    read_map: float = 0.0  # events/s: the relay's EventSource and Mapper alone, no broker
    references: dict[str, float] = field(default_factory=dict)  # label -> msgs/s
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the whole broker, set-up and clean-up included

    @property
    def raw_mean(self) -> float:
        rates = [t.rate for t in (self.raw_before, self.raw_after) if t is not None]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def ratio(self) -> float:
        return self.relay.rate / self.raw_mean if self.relay and self.raw_mean else 0.0

    @property
    def in_turn(self) -> float:
        """Events/s if reading and mapping, then publishing, took turns with no overlap."""
        if not self.read_map or not self.raw_mean:
            return 0.0
        return 1 / (1 / self.read_map + 1 / self.raw_mean)


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

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> rb.Throughput:
        """The raw client on the same messages; `tag` is "1" (before) or "2" (after)."""


def rate_of(t: rb.Throughput) -> str:
    return f"{t.rate:,.0f} msgs/s ({t.count:,} in {t.seconds:.2f}s, {t.stored:,} stored)"


# -- NATS: the machine's server; the raw client is relay_bench's ceiling ------------------------


class Nats:
    label = "nats-py `js.publish` x500 gathered, every PubAck awaited"

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = ""
        self.references: dict[str, float] = {}

    async def start(self, name: str, stack: contextlib.AsyncExitStack) -> str:
        self.name = name
        version = await rb.create_stream(self.url, name)
        stack.push_async_callback(
            quietly, f"delete stream {name}", rb.delete_stream, self.url, name
        )
        return f"nats-server {version}"

    def broker(self) -> dict[str, Any] | None:
        return None

    def destination(self) -> str | None:
        return None

    async def before_relay(self) -> None:
        await rb.purge_stream(self.url, self.name)

    async def stored(self, expected: int) -> int:
        return await rb.stored_messages(self.url, self.name)

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> rb.Throughput:
        """Mirror order, as in relay_bench: ceiling, reference | relay | reference, ceiling."""
        result: rb.Throughput | None = None
        for pipelined in (False, True) if tag == "1" else (True, False):
            t = await rb.ceiling(
                config,
                self.url,
                last,
                batch,
                f"{'p' if pipelined else 'c'}{tag}",
                pipelined=pipelined,
            )
            if pipelined:
                self.references[f"`publish_async` x{batch} pipelined, run {tag}"] = t.rate
                rb.say(f"  reference {tag}, publish_async pipelined: {rate_of(t)}")
            else:
                result = t
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

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> rb.Throughput:
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
            count, seconds = await rb.timed_publish(config, last, batch, prepare, send)
        finally:
            await producer.stop()
        return rb.Throughput(count, seconds, await self.stored(count))


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

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> rb.Throughput:
        await self.before_relay()  # purge
        connection = await aio_pika.connect(self.url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.get_exchange(self.name, ensure=False)
            AmqpChunk = list[tuple[aio_pika.Message, str]]

            def prepare(messages: list[Message]) -> AmqpChunk:
                return [(amqp_message(m), _routing_key(m)) for m in messages]

            async def send(chunk: AmqpChunk) -> None:
                await asyncio.gather(
                    *(exchange.publish(m, routing_key=key, mandatory=True) for m, key in chunk)
                )

            count, seconds = await rb.timed_publish(config, last, batch, prepare, send)
        finally:
            await connection.close()
        return rb.Throughput(count, seconds, await self.stored(count))


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

    async def raw(self, config: RelayConfig, last: int, batch: int, tag: str) -> rb.Throughput:
        assert self.server is not None
        name = self.queue_name(f"raw{tag}")
        url = await self._queue(name)
        slots = asyncio.Semaphore(CONCURRENCY)
        # The adapter's client settings (relay/brokers/sqs.py, connect).
        client_config = Config(
            retries={"mode": "standard", "total_max_attempts": 2},
            max_pool_connections=CONCURRENCY,
        )
        SqsChunk = list[list[dict[str, Any]]]

        def prepare(messages: list[Message]) -> SqsChunk:
            entries = [
                {
                    "Id": str(i),
                    "MessageBody": m.body.decode(),
                    "MessageAttributes": _attributes(m),
                    "MessageGroupId": _group_id(m.key),
                    "MessageDeduplicationId": _deduplication_id(m.id),
                }
                for i, m in enumerate(messages)
            ]
            return [entries[i : i + MAX_ENTRIES] for i in range(0, len(entries), MAX_ENTRIES)]

        session = aioboto3.Session(region_name=sqs_server.REGION)
        async with session.client("sqs", endpoint_url=self.server.url, config=client_config) as c:

            async def call(entries: list[dict[str, Any]]) -> None:
                async with slots:
                    response = await c.send_message_batch(QueueUrl=url, Entries=entries)
                if response.get("Failed"):
                    raise RuntimeError(f"SQS refused entries: {response['Failed'][:3]}")

            async def send(chunk: SqsChunk) -> None:
                await asyncio.gather(*(call(entries) for entries in chunk))

            await c.get_queue_attributes(QueueUrl=url)  # connection opened outside the timer
            count, seconds = await rb.timed_publish(config, last, batch, prepare, send)
        return rb.Throughput(count, seconds, await self.stored(count, name))


# -- the run -----------------------------------------------------------------------------------


async def read_and_map(config: RelayConfig, last: int, batch: int) -> float:
    """Events/s of reading and mapping the backlog, `batch` at a time, with nothing sent."""

    async def nothing(_: list[Message]) -> None:
        return None

    started = time.perf_counter()
    count, _ = await rb.timed_publish(config, last, batch, lambda m: m, nothing)
    return count / (time.perf_counter() - started)


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def target_for(broker: str, args: argparse.Namespace) -> Target:
    if broker == "nats":
        return Nats(args.nats)
    if broker == "kafka":
        return Kafka()
    if broker == "rabbitmq":
        return RabbitMq(args.rabbitmq)
    return Sqs()


def check(row: Row, what: str, t: rb.Throughput, expected: int) -> None:
    if t.count != expected or t.stored != expected:
        row.problems.append(f"{what}: sent {t.count:,}, destination holds {t.stored:,}")


async def bench_broker(broker: str, args: argparse.Namespace) -> Row:
    """Measure one broker; a failure is reported in the row, after everything is removed."""
    events = args.sqs_events if broker == "sqs" else args.events
    row = Row(broker=broker, events=events, load_at_start=load_average())
    target = target_for(broker, args)
    row.raw_client = target.label.replace("x500", f"x{args.batch}")
    started = time.perf_counter()
    try:
        await measure(row, target, args)
    except Exception as exc:  # noqa: BLE001 - reported; the other brokers still run
        rb.say(f"  {broker} FAILED: {exc!r}")
        row.problems.append(f"failed: {exc!r}")
    row.seconds = time.perf_counter() - started
    return row


async def measure(row: Row, target: Target, args: argparse.Namespace) -> None:
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = rb.with_database(args.pg, name)
    rb.say(f"\n{row.broker}: database {name}, load average {row.load_at_start}")
    async with contextlib.AsyncExitStack() as stack:
        await rb.admin_execute(args.pg, f'CREATE DATABASE "{name}"')
        drop = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
        stack.push_async_callback(quietly, f"drop database {name}", rb.admin_execute, args.pg, drop)
        row.server = await target.start(name, stack)
        rb.say(f"  server: {row.server}")
        await rb.admin_execute(dsn, rb.read_events_sql())
        config = rb.relay_config(
            dsn,
            args.nats,
            name,
            batch=args.batch,
            broker=target.broker(),
            destination=target.destination(),
        )
        await migrate(config)
        last = await rb.insert_backlog(dsn, row.events)
        rb.say(f"  {row.events:,} events inserted (last position {last})")
        row.read_map = await read_and_map(config, last, args.batch)
        rb.say(f"  read + map alone: {row.read_map:,.0f} events/s")

        row.raw_before = await target.raw(config, last, args.batch, "1")
        rb.say(f"  raw client, before: {rate_of(row.raw_before)}")
        await target.before_relay()
        profile = args.profile / f"{row.broker}.pstats" if args.profile else None
        if profile:
            profile.parent.mkdir(parents=True, exist_ok=True)
        run = await rb.relay_backlog(
            config, last, profile, lambda: target.stored(last), timeout=args.timeout
        )
        row.relay = run.throughput
        rb.say(
            f"  relay: {row.relay.rate:,.0f} events/s ({row.relay.seconds:.2f}s, "
            f"{row.relay.stored:,} stored)"
        )
        row.raw_after = await target.raw(config, last, args.batch, "2")
        rb.say(f"  raw client, after: {rate_of(row.raw_after)}")
        rb.say(f"  ratio relay / raw: {row.ratio:.2f}")
        row.references = target.references
        for what, t in (
            ("raw before", row.raw_before),
            ("relay", row.relay),
            ("raw after", row.raw_after),
        ):
            check(row, what, t, row.events)


async def quietly(what: str, action: Callable[..., Awaitable[object]], *args: Any) -> None:
    """A clean-up step: a failure is reported, and the other steps still run."""
    try:
        await action(*args)
    except Exception as exc:  # noqa: BLE001 - clean-up reports and goes on
        rb.say(f"  warning: could not {what}: {exc!r}")


async def bench(args: argparse.Namespace) -> tuple[list[Row], dict[str, str]]:
    configure("warning", "json")
    machine = await machine_info(args.pg)
    rb.say(f"load average at start (1/5/15 min): {machine['load average at start (1/5/15 min)']}")
    brokers = BROKERS if args.broker == "all" else (args.broker,)
    rows = [await bench_broker(broker, args) for broker in brokers]
    machine["load average at end (1/5/15 min)"] = load_average()
    return rows, machine


async def machine_info(pg: str) -> dict[str, str]:
    conn = await asyncpg.connect(pg)
    try:
        postgres = str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()
    versions = ["nats-py", "aiokafka", "aio-pika", "aiormq", "aioboto3", "botocore", "asyncpg"]
    return {
        "nproc": str(os.cpu_count()),
        "python": sys.version.split()[0],
        "postgres": postgres,
        "clients": ", ".join(f"{p} {metadata.version(p)}" for p in versions),
        "relay commit": rb.relay_revision(),
        "load average at start (1/5/15 min)": load_average(),
    }


# -- report ------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| broker | server | events | relay events/s | raw client msgs/s (mean of before / after)"
        " | ratio relay / raw | read + map alone, events/s | raw client |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.relay is None or r.raw_before is None or r.raw_after is None:
            lines.append(f"| {r.broker} | {r.server} | | failed | | | | {'; '.join(r.problems)} |")
            continue
        lines.append(
            f"| {r.broker} | {r.server} | {r.events:,} | {r.relay.rate:,.0f} "
            f"| {r.raw_mean:,.0f} ({r.raw_before.rate:,.0f} / {r.raw_after.rate:,.0f}) "
            f"| **{r.ratio:.2f}** | {r.read_map:,.0f} | {r.raw_client} |"
        )
    return "\n".join(lines)


def notes(rows: list[Row], machine: dict[str, str]) -> str:
    lines = []
    for r in rows:
        for label, value in r.references.items():
            ratio = r.relay.rate / value if r.relay and value else 0.0
            lines.append(
                f"- {r.broker}, reference {label}: {value:,.0f} msgs/s "
                f"(relay / reference {ratio:.2f})"
            )
        if r.in_turn and r.relay:
            lines.append(
                f"- {r.broker}: read + map, then the raw client, taking turns: "
                f"{r.in_turn:,.0f} events/s (relay / that: {r.relay.rate / r.in_turn:.2f})"
            )
        for problem in r.problems:
            lines.append(f"- {r.broker}: PROBLEM: {problem}")
        if r.seconds:
            lines.append(
                f"- {r.broker}: load average at its start {r.load_at_start}; "
                f"{r.seconds:.0f} s in all"
            )
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=[*BROKERS, "all"], default="all")
    parser.add_argument(
        "--events", type=int, default=20_000, help="backlog for NATS, Kafka and RabbitMQ"
    )
    parser.add_argument(
        "--sqs-events",
        type=int,
        default=500,
        help="backlog for SQS (moto slows down as its queues fill: see docs/performance.md)",
    )
    parser.add_argument(
        "--batch", type=int, default=500, help="relay batch.max_messages and raw chunk size"
    )
    parser.add_argument(
        "--timeout", type=float, default=240.0, help="seconds a relay drain may take at most"
    )
    parser.add_argument("--pg", default=rb.ADMIN_DSN, help="admin DSN of the Postgres server")
    parser.add_argument("--nats", default=rb.NATS_URL, help="NATS JetStream URL")
    parser.add_argument("--rabbitmq", default=RABBITMQ_URL, help="RabbitMQ URL")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="cProfile each relay drain into DIR/<broker>.pstats (makes the relay figures invalid)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    rows, machine = asyncio.run(bench(args))
    machine["wall time"] = f"{time.perf_counter() - started:.0f} s"
    rb.say("\n## Outbox Relay, every broker\n")
    rb.say(table(rows))
    rb.say("")
    rb.say(notes(rows, machine))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"rows": [asdict(r) | {"ratio": r.ratio} for r in rows], "machine": machine}
        args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
