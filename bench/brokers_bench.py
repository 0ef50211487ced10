"""Outbox Relay benchmark, every broker: backlog drain against the raw client, in one run.

    .venv/bin/python -m bench.brokers_bench [--broker all] [--events 20000] [--sqs-events 500]
        [--pubsub-events 5000]
    .venv/bin/python -m bench.brokers_bench --rabbitmq-adapter 5   # the adapter alone

Run from the repository's root: `bench` and `tests.support` are packages there.

For each broker (NATS JetStream, Kafka, RabbitMQ, SQS, Pub/Sub, Redis Streams, webhooks, SNS,
Kinesis), one after the other:

1. a fresh database `bench_<hex>` holding the example event table and the relay's schema, with a
   backlog of N BookLent events COPYed in (the same rows as `relay_bench.py`); a fresh
   destination: a file-backed JetStream stream on the machine's NATS; a 3-partition topic on a
   private tansu broker (Kafka protocol, started here); a durable queue bound with `#` to a fresh
   durable topic exchange on the machine's RabbitMQ; a FIFO queue per phase on a private moto
   server (SQS, started here, with fake credentials set in this process's environment; moto gets
   slower as a queue fills, and purges a queue at most once a minute); a topic and an ordered
   subscription per phase on a private Pub/Sub emulator (started here);
   it also times reading and mapping the backlog alone, with nothing sent, for reference;
2. the raw client publishes the relay's own messages (read with the relay's EventSource, mapped
   with its Mapper, converted with the adapter's own header/attribute helpers, all outside the
   timer), `--batch` at a time, with the adapter's acknowledgements and in-flight window:
   - NATS: nats-py `js.publish_async` x batch, then every PubAck (the reference of
     `relay_bench.py`, its headline denominator: how the relay's publisher sends); also, for
     information, `js.publish` x batch gathered, every PubAck awaited (its former ceiling);
   - Kafka: aiokafka `send()` of the batch's records, then every future awaited; acks=all,
     idempotence off (tansu has no InitProducerId), the adapter's other producer settings;
   - RabbitMQ: aio-pika `exchange.publish` x batch gathered, publisher confirms, mandatory,
     persistent, the adapter's properties and headers;
   - SQS: aioboto3 `send_message_batch` of 10 entries, at most 8 calls in flight (the adapter's
     CONCURRENCY), MessageGroupId = key, MessageDeduplicationId = message id;
   - Pub/Sub: google-cloud-pubsub `PublisherClient.publish` of the batch with ordering keys and
     the adapter's batch settings (each call made once), then every future awaited;
   - Redis: a redis-py pipeline (no transaction) of one XADD per message with the adapter's
     fields, one round trip per batch, on a private redis-server (started here); the relay
     also checks and records each id in the stream's dedup set, which the raw client does not;
   - webhooks: aiohttp `session.post` per message to a bare aiohttp.web receiver in a process
     of its own (tests/support/webhook_server.py), 16 in flight (the adapter's default
     max_in_flight), one request per key at a time, signed headers made outside the timer;
   - SNS: aioboto3 `publish_batch` of 10 entries to a FIFO topic, as for SQS; what was stored is
     counted in a FIFO queue subscribed to the topic with raw delivery (a topic per phase);
   - Kinesis: aioboto3 `put_records` of up to 500 records (the adapter's structured events and
     partition keys), one call at a time, to a 4-shard stream per phase, counted by reading it;
3. the real relay (`relay.runtime.runner.Relay`, in this process, http off, logging at warning,
   default batch 500 and linger 10 ms) relays the backlog to that broker; it is timed from its
   start until `relay.checkpoints` reaches the last position, on the wall clock and on this
   process's CPU clock (user + system), which gives the relay's CPU per event: the brokers,
   Postgres and the private servers are other processes;
4. the raw client again (mirror order; for NATS: ceiling, reference | relay | reference,
   ceiling, as in `relay_bench.py`), and the ratio relay / mean(raw before, raw after); the
   raw client's CPU per message is measured over its publishing alone, for comparison;
5. everything is removed, even on failure: database, stream, topic, exchange and queue, and
   the private tansu and moto servers are stopped.

Every phase checks that the destination then holds exactly N new messages. Prints a Markdown
table at the end. The broker targets are in `bench/broker_targets.py`. Importing this module
has no side effects.

With `--rabbitmq-adapter ROUNDS` it only compares the RabbitMQ adapter with raw aio-pika on
20,000 pre-built messages against the machine's RabbitMQ, alternating the order each round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import asyncpg

from bench import backlog, report
from bench.broker_targets import (
    RABBITMQ_URL,
    Http,
    Kafka,
    Kinesis,
    Nats,
    PubSub,
    RabbitMq,
    Redis,
    Sns,
    Sqs,
    Target,
    quietly,
    rabbitmq_adapter_rounds,
    rate_of,
)
from bench.measure import relay_backlog, timed_publish
from relay.config import RelayConfig
from relay.core.publishing import Message
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from relay.runtime.logs import configure

BROKERS = ("nats", "kafka", "rabbitmq", "sqs", "pubsub", "redis", "http", "sns", "kinesis")
MOTO = (
    "sqs",
    "sns",
    "kinesis",
)  # served by a private moto server: a smaller backlog (--sqs-events)


@dataclass
class Row:
    broker: str
    events: int
    server: str = "?"
    load_at_start: str = ""
    relay: report.Throughput | None = None
    raw_before: report.Throughput | None = None
    raw_after: report.Throughput | None = None
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
    def relay_cpu_us(self) -> float:
        """The relay's CPU per event over the whole drain: read, map, publish, checkpoint."""
        return self.relay.cpu_us_per_msg if self.relay else 0.0

    @property
    def raw_cpu_us(self) -> float:
        """The raw client's CPU per message, publishing only: mean of before and after."""
        return report.mean_of([t.cpu_us_per_msg for t in (self.raw_before, self.raw_after) if t])

    @property
    def in_turn(self) -> float:
        """Events/s if reading and mapping, then publishing, took turns with no overlap."""
        if not self.read_map or not self.raw_mean:
            return 0.0
        return 1 / (1 / self.read_map + 1 / self.raw_mean)


async def read_and_map(config: RelayConfig, last: int, batch: int) -> float:
    """Events/s of reading and mapping the backlog, `batch` at a time, with nothing sent."""

    async def nothing(_: list[Message]) -> None:
        return None

    started = time.perf_counter()
    result = await timed_publish(config, last, batch, lambda m: m, nothing)
    return result.count / (time.perf_counter() - started)


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def target_for(broker: str, args: argparse.Namespace) -> Target:
    if broker == "nats":
        return Nats(args.nats)
    if broker == "kafka":
        return Kafka()
    if broker == "rabbitmq":
        return RabbitMq(args.rabbitmq)
    if broker == "pubsub":
        return PubSub()
    if broker == "redis":
        return Redis()
    if broker == "http":
        return Http()
    if broker == "sns":
        return Sns()
    if broker == "kinesis":
        return Kinesis()
    return Sqs()


def check(row: Row, what: str, t: report.Throughput, expected: int) -> None:
    if t.count != expected or t.stored != expected:
        row.problems.append(f"{what}: sent {t.count:,}, destination holds {t.stored:,}")


async def bench_broker(broker: str, args: argparse.Namespace) -> Row:
    """Measure one broker; a failure is reported in the row, after everything is removed."""
    events = args.sqs_events if broker in MOTO else args.events
    events = {"pubsub": args.pubsub_events, "http": args.http_events}.get(broker, events)
    row = Row(broker=broker, events=events, load_at_start=load_average())
    target = target_for(broker, args)
    row.raw_client = target.label.replace("x500", f"x{args.batch}")
    started = time.perf_counter()
    try:
        await measure(row, target, args)
    except Exception as exc:  # noqa: BLE001 - reported; the other brokers still run
        report.say(f"  {broker} FAILED: {exc!r}")
        row.problems.append(f"failed: {exc!r}")
    row.seconds = time.perf_counter() - started
    return row


async def measure(row: Row, target: Target, args: argparse.Namespace) -> None:
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = backlog.with_database(args.pg, name)
    report.say(f"\n{row.broker}: database {name}, load average {row.load_at_start}")
    async with contextlib.AsyncExitStack() as stack:
        await backlog.admin_execute(args.pg, f'CREATE DATABASE "{name}"')
        drop = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
        stack.push_async_callback(
            quietly, f"drop database {name}", backlog.admin_execute, args.pg, drop
        )
        row.server = await target.start(name, stack)
        report.say(f"  server: {row.server}")
        await backlog.admin_execute(dsn, backlog.read_events_sql())
        config = backlog.relay_config(
            dsn,
            args.nats,
            name,
            batch=args.batch,
            broker=target.broker(),
            destination=target.destination(),
        )
        await migrate_database(Database(config.database, "relay:bench:0"), config)
        last = await backlog.insert_backlog(dsn, row.events)
        report.say(f"  {row.events:,} events inserted (last position {last})")
        row.read_map = await read_and_map(config, last, args.batch)
        report.say(f"  read + map alone: {row.read_map:,.0f} events/s")

        row.raw_before = await target.raw(config, last, args.batch, "1")
        report.say(f"  raw client, before: {rate_of(row.raw_before)}")
        await target.before_relay()
        profile = args.profile / f"{row.broker}.pstats" if args.profile else None
        if profile:
            profile.parent.mkdir(parents=True, exist_ok=True)
        run = await relay_backlog(
            config, last, profile, lambda: target.stored(last), timeout=args.timeout
        )
        row.relay = run.throughput
        report.say(f"  relay: {rate_of(row.relay, 'event')}")
        row.raw_after = await target.raw(config, last, args.batch, "2")
        report.say(f"  raw client, after: {rate_of(row.raw_after)}")
        report.say(f"  ratio relay / raw: {row.ratio:.2f}")
        row.references = target.references
        for what, t in (
            ("raw before", row.raw_before),
            ("relay", row.relay),
            ("raw after", row.raw_after),
        ):
            check(row, what, t, row.events)


async def bench(args: argparse.Namespace) -> tuple[list[Row], dict[str, str]]:
    configure("warning", "json")
    machine = await machine_info(args.pg)
    report.say(
        f"load average at start (1/5/15 min): {machine['load average at start (1/5/15 min)']}"
    )
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
    versions = [
        "nats-py",
        "aiokafka",
        "aio-pika",
        "aiormq",
        "aioboto3",
        "botocore",
        "aiohttp",
        "asyncpg",
    ]
    return {
        "nproc": str(os.cpu_count()),
        "python": sys.version.split()[0],
        "postgres": postgres,
        "clients": ", ".join(f"{p} {metadata.version(p)}" for p in versions),
        "relay commit": backlog.relay_revision(),
        "load average at start (1/5/15 min)": load_average(),
    }


# -- report ------------------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = [
        "| broker | server | events | relay events/s | raw client msgs/s (mean of before / after)"
        " | ratio relay / raw | relay CPU µs/event (drain) | raw client CPU µs/msg (publishing)"
        " | read + map alone, events/s | raw client |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.relay is None or r.raw_before is None or r.raw_after is None:
            failed = f"| {r.broker} | {r.server} | | failed | | | | | | {'; '.join(r.problems)} |"
            lines.append(failed)
            continue
        lines.append(
            f"| {r.broker} | {r.server} | {r.events:,} | {r.relay.rate:,.0f} "
            f"| {r.raw_mean:,.0f} ({r.raw_before.rate:,.0f} / {r.raw_after.rate:,.0f}) "
            f"| **{r.ratio:.2f}** | {r.relay_cpu_us:.1f} ({r.relay.cpu_share:.0%} of a core) "
            f"| {r.raw_cpu_us:.1f} | {r.read_map:,.0f} | {r.raw_client} |"
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


def row_json(r: Row) -> dict[str, object]:
    return asdict(r) | {
        "ratio": r.ratio,
        "relay_cpu_us_per_event": r.relay_cpu_us,
        "raw_cpu_us_per_msg": r.raw_cpu_us,
    }


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
        help="backlog for SQS and SNS (moto slows down as its queues fill: see"
        " docs/performance.md)",
    )
    parser.add_argument(
        "--pubsub-events",
        type=int,
        default=5_000,
        help="backlog for Pub/Sub (the emulator; each phase's messages are pulled back to count)",
    )
    parser.add_argument(
        "--http-events",
        type=int,
        default=5_000,
        help="backlog for webhooks (a POST each: see docs/performance.md)",
    )
    parser.add_argument(
        "--batch", type=int, default=500, help="relay batch.max_messages and raw chunk size"
    )
    parser.add_argument(
        "--timeout", type=float, default=240.0, help="seconds a relay drain may take at most"
    )
    parser.add_argument("--pg", default=backlog.ADMIN_DSN, help="admin DSN of the Postgres server")
    parser.add_argument("--nats", default=backlog.NATS_URL, help="NATS JetStream URL")
    parser.add_argument("--rabbitmq", default=RABBITMQ_URL, help="RabbitMQ URL")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--rabbitmq-adapter",
        type=int,
        metavar="ROUNDS",
        help="only the RabbitMQ adapter against raw aio-pika, no Postgres (e.g. 5 rounds)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="cProfile each relay drain into DIR/<broker>.pstats (makes the relay figures invalid)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rabbitmq_adapter:
        asyncio.run(rabbitmq_adapter_rounds(args.rabbitmq, args.rabbitmq_adapter))
        return 0
    started = time.perf_counter()
    rows, machine = asyncio.run(bench(args))
    machine["wall time"] = f"{time.perf_counter() - started:.0f} s"
    report.say("\n## Outbox Relay, every broker\n")
    report.say(table(rows))
    report.say("")
    report.say(notes(rows, machine))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"rows": [row_json(r) for r in rows], "machine": machine}
        args.json.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
