"""Outbox Relay benchmark: backlog throughput against the nats-py ceiling, memory, latency.

    .venv/bin/python -m bench.relay_bench [--events 100000] [--batch 500]

One run, against the machine's Postgres (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222):

1. creates a fresh database `bench_<hex>` holding the example event table, migrates the relay's
   schema, creates a fresh file-backed stream `bench_<hex>` (subjects `bench_<hex>.>`) and COPYs
   a backlog of N BookLent events (about 1000 aggregates, versions rising per aggregate);
2. measures the ceiling: plain nats-py `js.publish` of the same mapped messages (same subjects,
   bodies and headers, a distinct Nats-Msg-Id), `--batch` calls gathered at a time, every
   PubAck awaited; only the publishing is timed. As a reference it also measures
   `js.publish_async` pipelining (`--batch` in flight, then all PubAcks awaited), which is how
   the relay's own NATS publisher sends a batch;
3. relays the backlog with the real relay (`relay.ops.runner.Relay`, in this process, default batch
   and retry settings) and times it from start until `relay.checkpoints` reaches the last
   position, sampling RSS on the way;
4. measures the reference and the ceiling again (in mirror order), and reports
   relay / mean(ceiling before, ceiling after), the headline figure;
5. measures commit-to-broker latency at a steady rate (default 1000 events/s for 15 s), once with
   the NOTIFY trigger and once relying on the default 1 s poll; the writer and the NATS
   subscriber run in a child process so they do not share the relay's event loop;
6. drops the database and deletes the stream, even on failure, and prints a Markdown summary.

Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import multiprocessing
import os
import random
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from relay.brokers.nats import _headers  # the relay's exact CloudEvents headers
from relay.config import RelayConfig
from relay.core.mapping import Mapper
from relay.core.publishing import Message
from relay.ops.logs import configure
from relay.ops.runner import Relay
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from relay.postgres.source import EventSource

ROOT = Path(__file__).resolve().parents[1]
EVENTS_SQL = ROOT / "config" / "events.example.sql"
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
NATS_URL = "nats://127.0.0.1:4222"
OUTBOX = "loans"
AGGREGATE_TYPE = "book"
EVENT_TYPE = "BookLent"
AGGREGATES = 1000
COPY_CHUNK = 10_000
POLL = 0.05  # checkpoint polling period during the backlog run
PROGRESS = (25, 50, 75, 100)

Prepared = TypeVar("Prepared")


# -- results ------------------------------------------------------------------------------


@dataclass
class Throughput:
    count: int
    seconds: float
    stored: int = -1  # messages in the stream afterwards (it is purged before each phase)

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RelayRun:
    throughput: Throughput
    maxrss_before_kib: int
    maxrss_after_kib: int
    vmrss_start_kib: int
    vmrss_at_kib: dict[int, int]  # progress percent -> VmRSS
    vmrss_peak_kib: int
    stored: int  # messages in the stream afterwards


@dataclass
class Latency:
    mode: str
    rate_target: float
    rate_achieved: float
    sent: int
    measured: int
    missing: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


@dataclass
class Results:
    events: int
    batch: int
    machine: dict[str, str] = field(default_factory=dict)
    insert_seconds: float = 0.0
    ceiling_before: Throughput | None = None
    ceiling_after: Throughput | None = None
    pipelined_before: Throughput | None = None  # reference: publish_async, the relay's path
    pipelined_after: Throughput | None = None
    relay: RelayRun | None = None
    latency: list[Latency] = field(default_factory=list)

    @property
    def ceiling_mean(self) -> float:
        rates = [c.rate for c in (self.ceiling_before, self.ceiling_after) if c is not None]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def ratio(self) -> float:
        mean = self.ceiling_mean
        return self.relay.throughput.rate / mean if self.relay and mean else 0.0

    @property
    def pipelined_mean(self) -> float:
        rates = [c.rate for c in (self.pipelined_before, self.pipelined_after) if c is not None]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def pipelined_ratio(self) -> float:
        mean = self.pipelined_mean
        return self.relay.throughput.rate / mean if self.relay and mean else 0.0


# -- helpers ------------------------------------------------------------------------------


def vmrss_kib() -> int:
    """Resident set size now, from /proc/self/status (Linux), in KiB."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def maxrss_kib() -> int:
    """Peak resident set size of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


def percentile(ordered: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def read_events_sql() -> str:
    return EVENTS_SQL.read_text(encoding="utf-8")


def relay_config(
    dsn: str,
    nats_url: str,
    subject: str,
    *,
    batch: int,
    notify_trigger: bool = False,
    poll_interval: str = "100ms",
    broker: dict[str, Any] | None = None,
    destination: str | None = None,
) -> RelayConfig:
    """Like tests/support/scenario.config_dict, with default retry, batch and park settings.

    Only `batch.max_messages` follows `--batch` (500, the default, unless told otherwise);
    `linger` stays at its 10 ms default. By default the broker is NATS at `nats_url` and the
    destination `<subject>.{aggregate_type}`; `broker` (a broker config, named after its
    `type`) and `destination` (a template) relay to another one.
    """
    if broker is None:
        broker = {"type": "nats", "servers": [nats_url], "ack_timeout": "1s"}
    if destination is None:
        destination = f"{subject}.{{aggregate_type}}"
    data: dict[str, Any] = {
        "database": {"url": dsn, "schema": "relay"},
        "source": {
            "poll_interval": poll_interval,
            "barrier_report_after": "200ms",
            "notify_trigger": notify_trigger,
        },
        "brokers": {broker["type"]: broker},
        # A lease namespace of its own: the lock key is then unique on this Postgres server,
        # so no other relay's standby (in another database) can mistake ours for its holder.
        "lease": {"namespace": subject},
        "outboxes": {
            OUTBOX: {
                "broker": broker["type"],
                "batch": {"max_messages": batch},
                "messages": {
                    EVENT_TYPE: {
                        "type": "library.book-lent.v1",
                        "destination": destination,
                        "payload": {
                            "bookId": "aggregate_id",
                            "loanId": "data.loanId",
                            "memberId": "data.memberId",
                            "version": "version",
                        },
                    }
                },
            }
        },
        "logging": {"level": "warning", "format": "json"},
        "http": {"enabled": False},
        "shutdown": {"grace_period": "5s"},
    }
    return RelayConfig(**data)


def aggregate_ids(rng: random.Random, count: int) -> list[str]:
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


def backlog_rows(count: int, seed: int = 42) -> Iterator[tuple[str, str, int, str, str]]:
    """(aggregate_type, aggregate_id, version, type, payload) for `count` events."""
    rng = random.Random(seed)
    books = aggregate_ids(rng, AGGREGATES)
    members = aggregate_ids(rng, 5000)
    for i in range(count):
        payload = json.dumps(
            {
                "loanId": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                "memberId": rng.choice(members),
            }
        )
        yield AGGREGATE_TYPE, books[i % AGGREGATES], i // AGGREGATES + 1, EVENT_TYPE, payload


# -- setup and teardown -------------------------------------------------------------------


async def admin_execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def nats_connection(url: str) -> AsyncIterator[Client]:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
    try:
        yield nc
    finally:
        await nc.close()


async def create_stream(url: str, name: str) -> str:
    """Create the stream; return the server's version."""
    async with nats_connection(url) as nc:
        config = StreamConfig(name=name, subjects=[f"{name}.>"], storage=StorageType.FILE)
        await nc.jetstream().add_stream(config)
        v = nc.connected_server_version
        return f"{v.major}.{v.minor}.{v.patch}"


async def purge_stream(url: str, name: str) -> None:
    async with nats_connection(url) as nc:
        await nc.jetstream().purge_stream(name)


async def stored_messages(url: str, name: str) -> int:
    async with nats_connection(url) as nc:
        info = await nc.jetstream().stream_info(name)
        return int(info.state.messages)


async def delete_stream(url: str, name: str) -> None:
    async with nats_connection(url) as nc:
        with contextlib.suppress(NotFoundError):
            await nc.jetstream().delete_stream(name)


async def insert_backlog(dsn: str, count: int) -> int:
    """COPY `count` events in; return the last position."""
    conn = await asyncpg.connect(dsn)
    try:
        columns = ["aggregate_type", "aggregate_id", "version", "type", "payload"]
        rows = backlog_rows(count)
        while chunk := [row for _, row in zip(range(COPY_CHUNK), rows, strict=False)]:
            await conn.copy_records_to_table("events", records=chunk, columns=columns)
        await conn.execute("ANALYZE events")
        return int(await conn.fetchval("SELECT coalesce(max(position), 0) FROM events"))
    finally:
        await conn.close()


# -- the ceiling: plain nats-py -----------------------------------------------------------


async def timed_publish(
    config: RelayConfig,
    last: int,
    batch: int,
    prepare: Callable[[list[Message]], Prepared],
    send: Callable[[Prepared], Awaitable[None]],
) -> tuple[int, float]:
    """Read and map the backlog `batch` events at a time, and time only the sending.

    Each chunk is read with the relay's EventSource and mapped with its Mapper, then turned
    into what the client sends (`prepare`); all that happens before the chunk's timer starts,
    so only `send` (the client's calls and the broker's acknowledgements) is measured, and
    memory stays bounded. Returns (messages sent, seconds spent in `send`).
    """
    source = EventSource(config.source)
    mapper = Mapper(OUTBOX, config.outboxes[OUTBOX])
    conn = await asyncpg.connect(config.database.url.get_secret_value())
    published, elapsed, position = 0, 0.0, 0
    try:
        while position < last:
            events = await source.read(
                conn, after=position, upto=last, limit=batch, aggregates=None, types=[EVENT_TYPE]
            )
            if not events:
                break
            position = events[-1].position
            messages = []
            for event in events:
                message = mapper.map(event)
                assert message is not None
                messages.append(message)
            chunk = prepare(messages)
            started = time.perf_counter()
            await send(chunk)
            elapsed += time.perf_counter() - started
            published += len(messages)
    finally:
        await conn.close()
    return published, elapsed


async def ceiling(
    config: RelayConfig,
    nats_url: str,
    last: int,
    batch: int,
    tag: str,
    *,
    pipelined: bool = False,
) -> Throughput:
    """Publish the relay's own messages, `batch` at a time, and time only the publishing.

    The ceiling is `batch` `js.publish` calls gathered at a time, every PubAck awaited. With
    `pipelined`, a reference: `batch` `js.publish_async` calls, then all their PubAcks awaited,
    which is how the relay's NATS publisher sends a batch.

    Reading and mapping stay outside the timer (see `timed_publish`). The stream is purged
    first, and every message gets a Nats-Msg-Id of its own (`<id>#<tag>`), so none is dropped
    as a duplicate of an earlier phase's.
    """
    await purge_stream(nats_url, stream_of(config))
    NatsChunk = list[tuple[str, bytes, dict[str, str]]]

    def prepare(messages: list[Message]) -> NatsChunk:
        return [
            (m.destination, m.body, {**_headers(m), "Nats-Msg-Id": f"{m.id}#{tag}"})
            for m in messages
        ]

    async with nats_connection(nats_url) as nc:
        js = nc.jetstream(timeout=5.0)
        await js.account_info()

        async def send(chunk: NatsChunk) -> None:
            if pipelined:
                acks = [await js.publish_async(s, b, headers=h) for s, b, h in chunk]
                await asyncio.gather(*acks)
            else:
                await asyncio.gather(*(js.publish(s, b, headers=h) for s, b, h in chunk))

        published, elapsed = await timed_publish(config, last, batch, prepare, send)
    return Throughput(published, elapsed, await stored_messages(nats_url, stream_of(config)))


def stream_of(config: RelayConfig) -> str:
    """The stream (and subject prefix) is named after the database: `bench_<hex>`."""
    return urlsplit(config.database.url.get_secret_value()).path.lstrip("/")


# -- the relay on the backlog -------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(config: RelayConfig) -> AsyncIterator[Relay]:
    """The real relay in this loop; stopped gracefully, and it must exit 0."""
    relay = Relay(config)
    task = asyncio.create_task(relay.run(), name="relay-under-bench")
    try:
        yield relay
    finally:
        relay.stop.set()
        code = await asyncio.wait_for(task, timeout=30)
        if code != 0:
            raise RuntimeError(f"the relay exited {code}")


async def checkpoint(conn: asyncpg.Connection) -> int:
    value = await conn.fetchval("SELECT position FROM relay.checkpoints WHERE outbox = $1", OUTBOX)
    return int(value or 0)


async def relay_backlog(
    config: RelayConfig,
    last: int,
    profile: Path | None,
    count_stored: Callable[[], Awaitable[int]],
    timeout: float | None = None,  # noqa: ASYNC109 - a deadline for the whole drain
) -> RelayRun:
    """Run the relay until its checkpoint reaches `last`; `count_stored` then counts what the
    destination holds. Fails if the relay stops, or if it has not finished within `timeout`
    seconds (a broker that keeps refusing would otherwise keep it retrying for ever)."""
    gc.collect()
    maxrss_before, vmrss_start = maxrss_kib(), vmrss_kib()
    marks: dict[int, int] = {}
    peak = vmrss_start
    profiler = cProfile.Profile() if profile else None
    conn = await asyncpg.connect(config.database.url.get_secret_value())
    try:
        if profiler:
            profiler.enable()
        started = time.perf_counter()
        async with running(config) as relay:
            tick = started
            while True:
                position = await checkpoint(conn)
                now, rss = time.perf_counter(), vmrss_kib()
                peak = max(peak, rss)
                for pct in PROGRESS:
                    if pct not in marks and position * 100 >= last * pct:
                        marks[pct] = rss
                if position >= last:
                    break
                if relay.states.get(OUTBOX) and relay.states[OUTBOX].role == "stopped":
                    raise RuntimeError("the relay stopped before draining the backlog")
                if timeout is not None and now - started > timeout:
                    raise RuntimeError(
                        f"the relay reached position {position} of {last} in {timeout:g}s"
                    )
                tick += POLL
                await asyncio.sleep(max(0.0, tick - time.perf_counter()))
        if profiler and profile:
            profiler.disable()
            profiler.dump_stats(profile)
    finally:
        await conn.close()
    maxrss_after = maxrss_kib()
    stored = await count_stored()
    return RelayRun(
        throughput=Throughput(last, now - started, stored),
        maxrss_before_kib=maxrss_before,
        maxrss_after_kib=maxrss_after,
        vmrss_start_kib=vmrss_start,
        vmrss_at_kib=marks,
        vmrss_peak_kib=peak,
        stored=stored,
    )


# -- latency: a paced writer and a NATS subscriber, in a child process ---------------------


@dataclass(frozen=True)
class LoadSpec:
    dsn: str
    nats_url: str
    subject: str
    rate: float
    seconds: float
    warmup: float
    seed: int


def run_load(spec: LoadSpec) -> dict[str, Any]:
    """Child-process entry point: returns latencies (ms) of the events after the warm-up."""
    return asyncio.run(_load(spec))


async def _load(spec: LoadSpec) -> dict[str, Any]:
    received: dict[str, float] = {}
    committed: dict[str, float] = {}
    total = round(spec.rate * (spec.seconds + spec.warmup))
    all_in = asyncio.Event()

    async def on_message(msg: Any) -> None:
        received[msg.headers["Nats-Msg-Id"]] = time.monotonic()
        if len(received) >= total:
            all_in.set()

    books = aggregate_ids(random.Random(spec.seed), AGGREGATES)
    warm = round(spec.rate * spec.warmup)
    insert = (
        "INSERT INTO events (aggregate_type, aggregate_id, version, type, payload)"
        " VALUES ($1, $2, $3, $4, $5::jsonb)"
    )
    async with nats_connection(spec.nats_url) as nc:
        await nc.subscribe(f"{spec.subject}.>", cb=on_message, pending_msgs_limit=1_000_000)
        await nc.flush()
        conn = await asyncpg.connect(spec.dsn)
        try:
            await conn.execute("SELECT 1")
            start = time.monotonic() + 0.05
            for k in range(total):
                delay = start + k / spec.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                book, version = books[k % AGGREGATES], k // AGGREGATES + 1
                payload = json.dumps({"loanId": f"loan-{k}", "memberId": f"member-{k % 997}"})
                await conn.execute(insert, AGGREGATE_TYPE, book, version, EVENT_TYPE, payload)
                if k >= warm:
                    committed[f"{AGGREGATE_TYPE}/{book}@{version}"] = time.monotonic()
            wrote = time.monotonic() - start
        finally:
            await conn.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_in.wait(), 10.0)
    latencies = sorted(
        (received[key] - at) * 1000 for key, at in committed.items() if key in received
    )
    return {
        "sent": total,
        "rate": total / wrote,
        "latencies_ms": latencies,
        "missing": len(committed) - len(latencies),
    }


async def latency(
    config: RelayConfig, spec: LoadSpec, last: int, mode: str, pool: ProcessPoolExecutor
) -> Latency:
    await migrate_database(
        Database(config.database, "relay:bench:0"), config
    )  # installs the NOTIFY trigger, or removes it
    async with running(config) as relay:
        for _ in range(200):  # holding the lease and caught up with everything before
            state = relay.states.get(OUTBOX)
            if state and state.role == "holder" and (state.checkpoint or 0) >= last:
                break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"the relay did not catch up to position {last} within 10 s")
        await asyncio.sleep(0.5)
        out = await asyncio.get_running_loop().run_in_executor(pool, run_load, spec)
    values: list[float] = out["latencies_ms"]
    return Latency(
        mode=mode,
        rate_target=spec.rate,
        rate_achieved=round(out["rate"], 1),
        sent=out["sent"],
        measured=len(values),
        missing=out["missing"],
        p50_ms=round(percentile(values, 50), 2),
        p90_ms=round(percentile(values, 90), 2),
        p99_ms=round(percentile(values, 99), 2),
        max_ms=round(values[-1] if values else float("nan"), 2),
    )


# -- the run ------------------------------------------------------------------------------


async def machine_info(dsn: str, nats_version: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        pg = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    return {
        "nproc": str(os.cpu_count()),
        "python": sys.version.split()[0],
        "postgres": str(pg),
        "nats-server": nats_version,
        "nats-py": metadata.version("nats-py"),
        "asyncpg": asyncpg.__version__,
        "relay commit": relay_revision(),
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def relay_revision() -> str:
    """The commit of the relay under test, and whether relay/ has local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "relay"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (relay/ modified)" if dirty else head


def say(text: str) -> None:
    print(text, flush=True)


def rate(t: Throughput) -> str:
    return f"{t.rate:,.0f} msgs/s ({t.seconds:.2f}s; stream holds {t.stored:,})"


async def bench(args: argparse.Namespace) -> Results:
    configure("warning", "json")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = with_database(args.pg, name)
    results = Results(events=args.events, batch=args.batch)
    try:
        await admin_execute(args.pg, f'CREATE DATABASE "{name}"')
        nats_version = await create_stream(args.nats, name)
        await admin_execute(dsn, read_events_sql())
        config = relay_config(dsn, args.nats, name, batch=args.batch)
        await migrate_database(Database(config.database, "relay:bench:0"), config)
        results.machine = await machine_info(dsn, nats_version)
        say(f"database and stream {name}; inserting {args.events:,} events")

        started = time.perf_counter()
        last = await insert_backlog(dsn, args.events)
        results.insert_seconds = time.perf_counter() - started
        say(f"  inserted in {results.insert_seconds:.1f}s (last position {last})")

        # Symmetric order, so drift affects both sides alike: ceiling, reference, relay,
        # reference, ceiling.
        results.ceiling_before = await ceiling(config, args.nats, last, args.batch, "c1")
        say(f"ceiling (before), js.publish x{args.batch} gathered: {rate(results.ceiling_before)}")
        results.pipelined_before = await ceiling(
            config, args.nats, last, args.batch, "p1", pipelined=True
        )
        say(f"reference (before), publish_async pipelined: {rate(results.pipelined_before)}")

        await purge_stream(args.nats, name)
        results.relay = await relay_backlog(
            config, last, args.profile, lambda: stored_messages(args.nats, name)
        )
        say(
            f"relay: {results.relay.throughput.rate:,.0f} events/s "
            f"({results.relay.throughput.seconds:.2f}s; stream holds {results.relay.stored:,})"
        )

        results.pipelined_after = await ceiling(
            config, args.nats, last, args.batch, "p2", pipelined=True
        )
        say(f"reference (after), publish_async pipelined: {rate(results.pipelined_after)}")
        results.ceiling_after = await ceiling(config, args.nats, last, args.batch, "c2")
        say(f"ceiling (after), js.publish x{args.batch} gathered: {rate(results.ceiling_after)}")
        say(f"ratio relay/ceiling: {results.ratio:.3f}")
        if args.profile:
            say(f"NOTE: the relay ran under cProfile ({args.profile}): its figures are not valid")

        if args.latency_seconds > 0:
            await latency_phases(args, dsn, name, last, results)
    finally:
        await cleanup(args, name)
    return results


async def latency_phases(
    args: argparse.Namespace, dsn: str, name: str, last: int, results: Results
) -> None:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        for seed, (mode, trigger) in enumerate(
            (("NOTIFY trigger", True), ("polling (1s)", False)), start=1
        ):
            config = relay_config(
                dsn,
                args.nats,
                name,
                batch=args.batch,
                notify_trigger=trigger,
                poll_interval="1s",
            )
            spec = LoadSpec(
                dsn, args.nats, name, args.rate, args.latency_seconds, args.warmup, seed
            )
            result = await latency(config, spec, last, mode, pool)
            results.latency.append(result)
            last += result.sent
            say(
                f"latency, {mode}: p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms "
                f"({result.measured:,} events at {result.rate_achieved:,.0f}/s, "
                f"{result.missing} missing)"
            )


async def cleanup(args: argparse.Namespace, name: str) -> None:
    try:
        await delete_stream(args.nats, name)
    except Exception as exc:  # noqa: BLE001 - clean-up reports and goes on
        say(f"warning: could not delete stream {name}: {exc!r}")
    try:
        await admin_execute(args.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception as exc:  # noqa: BLE001 - clean-up reports and goes on
        say(f"warning: could not drop database {name}: {exc!r}")


# -- report -------------------------------------------------------------------------------


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def summary(r: Results) -> str:
    rows: list[tuple[str, str]] = [
        ("events in backlog", f"{r.events:,}"),
        ("batch (relay max_messages / ceiling gather)", str(r.batch)),
        ("backlog insert (COPY)", f"{r.insert_seconds:.1f} s"),
    ]
    if r.ceiling_before and r.ceiling_after and r.relay:
        run = r.relay
        rows += [
            ("ceiling before, nats-py js.publish", f"{r.ceiling_before.rate:,.0f} msgs/s"),
            ("ceiling after, nats-py js.publish", f"{r.ceiling_after.rate:,.0f} msgs/s"),
            ("ceiling, mean", f"{r.ceiling_mean:,.0f} msgs/s"),
            *(
                (f"reference {when}, nats-py publish_async pipelined", f"{t.rate:,.0f} msgs/s")
                for when, t in (("before", r.pipelined_before), ("after", r.pipelined_after))
                if t is not None
            ),
            (
                "relay, backlog drain",
                f"{run.throughput.rate:,.0f} events/s ({run.throughput.seconds:.2f} s)",
            ),
            ("**ratio relay / ceiling** (goal >= 0.8)", f"**{r.ratio:.2f}**"),
            ("ratio relay / publish_async reference (information)", f"{r.pipelined_ratio:.2f}"),
            ("peak RSS (ru_maxrss) before relay run", mib(run.maxrss_before_kib)),
            ("peak RSS (ru_maxrss) after relay run", mib(run.maxrss_after_kib)),
            ("VmRSS at start of relay run", mib(run.vmrss_start_kib)),
            *(
                (f"VmRSS at {pct}% of backlog", mib(run.vmrss_at_kib.get(pct, 0)))
                for pct in PROGRESS
            ),
            ("VmRSS peak during relay run", mib(run.vmrss_peak_kib)),
            ("messages stored by relay run", f"{run.stored:,}"),
        ]
    for lat in r.latency:
        rows.append(
            (
                f"commit-to-broker latency, {lat.mode}",
                f"p50 {lat.p50_ms:.1f} ms, p99 {lat.p99_ms:.1f} ms, max {lat.max_ms:.1f} ms "
                f"({lat.measured:,} events at {lat.rate_achieved:,.0f}/s, {lat.missing} missing)",
            )
        )
    rows += [(f"machine: {k}", v) for k, v in r.machine.items()]
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def to_json(r: Results) -> dict[str, Any]:
    data = asdict(r)
    data.update(
        ceiling_mean=r.ceiling_mean,
        ratio=r.ratio,
        pipelined_mean=r.pipelined_mean,
        pipelined_ratio=r.pipelined_ratio,
    )
    if r.relay:
        data["relay"]["rate"] = r.relay.throughput.rate
    for key in ("ceiling_before", "ceiling_after", "pipelined_before", "pipelined_after"):
        value = getattr(r, key)
        if value:
            data[key]["rate"] = value.rate
    return data


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000, help="backlog size")
    parser.add_argument(
        "--batch",
        type=int,
        default=500,
        help="relay batch.max_messages and ceiling gather size (default 500, the relay default)",
    )
    parser.add_argument("--rate", type=float, default=1000.0, help="latency: events/s")
    parser.add_argument(
        "--latency-seconds", type=float, default=15.0, help="latency: measured seconds (0: skip)"
    )
    parser.add_argument("--warmup", type=float, default=1.0, help="latency: seconds not measured")
    parser.add_argument("--pg", default=ADMIN_DSN, help="admin DSN of the Postgres server")
    parser.add_argument("--nats", default=NATS_URL, help="NATS JetStream URL")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="cProfile the relay's backlog run into this .pstats file (slows it down)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(bench(args))
    report = summary(results)
    say("\n## Outbox Relay benchmark\n")
    say(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(results), indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
