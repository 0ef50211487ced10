"""RabbitMQ publisher throughput against raw aio-pika, the same messages, the same pipelining.

    .venv/bin/python bench/rabbitmq_publisher_bench.py [--url amqp://...] [--rounds 5]

Against the machine's RabbitMQ (127.0.0.1:5672 by default): a fresh durable topic exchange and
a durable classic queue bound with `#` (both deleted at the end, even on failure); 20,000
pre-built relay `Message`s (about 80-byte JSON bodies, persistent) published

- through `RabbitMqPublisher.publish`, in batches of 500;
- with raw aio-pika: `exchange.publish` of 500 messages gathered, every confirm awaited
  (mandatory, same properties and headers), building the `aio_pika.Message`s in the timed loop;
- the same with the `aio_pika.Message`s built beforehand.

Only publishing is timed; the queue is purged before each run; the order of the three
alternates between rounds. Prints messages/s per run, the medians and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from datetime import UTC, datetime

import aio_pika
import aiormq
from pydantic import SecretStr

from relay.brokers.rabbitmq import RabbitMqPublisher
from relay.config import RabbitMqBrokerConfig
from relay.core.publishing import Message

N, BATCH = 20_000, 500
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


async def main(url: str, rounds: int) -> None:
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.rounds))
