"""Outbox Relay benchmark: one lane against what its broker client can do; CPU, memory, latency.

    .venv/bin/python -m bench.relay_bench [--events 100000] [--batch 500]
        [--payload-bytes 0] [--max-bytes N]

One run, against the machine's Postgres (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222):

1. creates a fresh database `bench_<hex>` holding the example event table, migrates the relay's
   schema, creates a fresh file-backed stream `bench_<hex>` (subjects `bench_<hex>.>`) and COPYs
   a backlog of N BookLent events (about 1000 aggregates, versions rising per aggregate); with
   `--payload-bytes N` each payload also carries a `note` of N ASCII bytes, which the mapping
   copies into the message, so each body is about N bytes;
2. measures the reference: nats-py `js.publish_async` of the same mapped messages (same
   subjects, bodies and headers, a distinct Nats-Msg-Id), `--batch` in flight, then all their
   PubAcks awaited, which is how the relay's own NATS publisher sends a batch; only the
   publishing is timed, on the wall clock and on the process's CPU clock. For information it
   also measures the former ceiling, `--batch` `js.publish` calls gathered, every PubAck awaited
   (slower: each call is a full request);
3. relays the backlog with the real relay (`relay.runtime.runner.Relay`, in this process,
   default batch and retry settings; `--max-bytes` sets `batch.max_bytes`) and times it from
   start until
   `relay.checkpoints` reaches the last position, on the wall clock and on the process's CPU
   clock (user + system: the relay's CPU per event); its memory peak is the kernel's VmHWM,
   reset at the start, checked against VmRSS sampled every 10 ms from a child process;
4. measures the reference and the ceiling again (in mirror order), and reports
   relay / mean(reference before, reference after), the headline figure (goal >= 0.85), and
   relay / mean(ceiling before, ceiling after), for information;
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
import string
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from bench.memory import RssSampler, maxrss_kib, reset_peak_rss, status_kib, trim_heap, vmrss_kib
from bench.report import (
    HEADLINE_GOAL,
    PROGRESS,
    Latency,
    RelayRun,
    Results,
    Throughput,
    summary,
    to_json,
)
from relay.brokers.nats import message_headers  # the relay's exact CloudEvents headers
from relay.config import RelayConfig
from relay.core.publishing import Message
from relay.mapping.mapper import Mapper
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database
from relay.postgres.source import EventSource
from relay.runtime.logs import configure
from relay.runtime.runner import Relay

ROOT = Path(__file__).resolve().parents[1]
EVENTS_SQL = ROOT / "config" / "events.example.sql"
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
NATS_URL = "nats://127.0.0.1:4222"
OUTBOX = "loans"
AGGREGATE_TYPE = "book"
EVENT_TYPE = "BookLent"
AGGREGATES = 1000
COPY_CHUNK = 10_000
COPY_BYTES = 32 * 1024 * 1024  # payload bytes per COPY chunk at most (big payloads)
POLL = 0.05  # checkpoint polling period during the backlog run
NOTE_ALPHABET = string.ascii_letters + string.digits

Prepared = TypeVar("Prepared")


# -- results ------------------------------------------------------------------------------


# -- helpers ------------------------------------------------------------------------------


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


# The message the bench relays, as a consumer's contract would describe it (`--schema`).
BOOK_LENT_SCHEMA: dict[str, Any] = {
    "$id": "https://schemas.example.com/library/book-lent.v1.json",
    "type": "object",
    "required": ["bookId", "loanId", "memberId", "version"],
    "additionalProperties": False,
    "properties": {
        "bookId": {"type": "string", "minLength": 1},
        "loanId": {"type": "string", "pattern": "^[0-9a-f-]{36}$"},
        "memberId": {"type": "string", "minLength": 1},
        "version": {"type": "integer", "minimum": 1},
        "note": {"type": "string"},
    },
}
SCHEMAS = ("none", "draft7", "2020-12")


def schema_for(kind: str) -> dict[str, Any] | None:
    """`none`, `draft7` (no `$schema`: run by fastjsonschema) or `2020-12` (by jsonschema)."""
    if kind == "none":
        return None
    if kind == "draft7":
        return BOOK_LENT_SCHEMA
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **BOOK_LENT_SCHEMA}


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
    note: bool = False,
    max_bytes: int | None = None,
    schema: dict[str, Any] | None = None,
) -> RelayConfig:
    """Like tests/support/scenario.config_dict, with default retry, batch and park settings.

    Only `batch.max_messages` follows `--batch` (500, the default, unless told otherwise);
    `linger` stays at its 10 ms default. By default the broker is NATS at `nats_url` and the
    destination `<subject>.{aggregate_type}`; `broker` (a broker config, named after its
    `type`) and `destination` (a template) relay to another one. `note` copies the payload's
    `note` (see `--payload-bytes`) into the message; `max_bytes` sets `batch.max_bytes`,
    which is left out when None, so that a relay without that key still takes the config.
    """
    if broker is None:
        broker = {"type": "nats", "servers": [nats_url], "ack_timeout": "1s"}
    if destination is None:
        destination = f"{subject}.{{aggregate_type}}"
    batch_config: dict[str, Any] = {"max_messages": batch}
    if max_bytes is not None:
        batch_config["max_bytes"] = max_bytes
    payload = {
        "bookId": "aggregate_id",
        "loanId": "data.loanId",
        "memberId": "data.memberId",
        "version": "version",
    }
    if note:
        payload["note"] = "data.note"
    rule: dict[str, Any] = {
        "type": "library.book-lent.v1",
        "destination": destination,
        "payload": payload,
    }
    if schema is not None:  # left out otherwise: a relay without schemas takes the config
        rule["schema"] = schema
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
                "batch": batch_config,
                "messages": {EVENT_TYPE: rule},
            }
        },
        "logging": {"level": "warning", "format": "json"},
        "http": {"enabled": False},
        "shutdown": {"grace_period": "5s"},
    }
    return RelayConfig(**data)


def aggregate_ids(rng: random.Random, count: int) -> list[str]:
    return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]


def backlog_rows(
    count: int, seed: int = 42, payload_bytes: int = 0
) -> Iterator[tuple[str, str, int, str, str]]:
    """(aggregate_type, aggregate_id, version, type, payload) for `count` events.

    With `payload_bytes`, each payload also has a `note` of that many ASCII letters and digits;
    the other fields are the same as without it.
    """
    rng = random.Random(seed)
    books = aggregate_ids(rng, AGGREGATES)
    members = aggregate_ids(rng, 5000)
    notes = note_source(payload_bytes, seed)
    for i in range(count):
        data = {
            "loanId": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
            "memberId": rng.choice(members),
        }
        if payload_bytes:
            data["note"] = next(notes)
        payload = json.dumps(data)
        yield AGGREGATE_TYPE, books[i % AGGREGATES], i // AGGREGATES + 1, EVENT_TYPE, payload


def note_source(size: int, seed: int) -> Iterator[str]:
    """Notes of `size` random characters: slices of one random block, at random offsets.

    Random, so that Postgres's TOAST compression does not shrink them (a run of one letter
    would be stored in a few bytes); slices, so that 64 KiB notes cost no more than a copy.
    """
    rng = random.Random(seed + 1)
    block = "".join(rng.choices(NOTE_ALPHABET, k=size + 1024 * 1024)) if size else ""
    while True:
        start = rng.randrange(len(block) - size + 1)
        yield block[start : start + size]


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


async def insert_backlog(dsn: str, count: int, payload_bytes: int = 0) -> int:
    """COPY `count` events in; return the last position.

    COPY goes by chunks of at most COPY_CHUNK rows and about COPY_BYTES of payload, so that
    the bench does not hold hundreds of MiB of big payloads at once.
    """
    per_chunk = max(1, min(COPY_CHUNK, COPY_BYTES // (payload_bytes + 200)))
    conn = await asyncpg.connect(dsn)
    try:
        columns = ["aggregate_type", "aggregate_id", "version", "type", "payload"]
        rows = backlog_rows(count, payload_bytes=payload_bytes)
        while chunk := [row for _, row in zip(range(per_chunk), rows, strict=False)]:
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
) -> Throughput:
    """Read and map the backlog `batch` events at a time, and time only the sending.

    Each chunk is read with the relay's EventSource and mapped with its Mapper, then turned
    into what the client sends (`prepare`); all that happens before the chunk's timers start,
    so only `send` (the client's calls and the broker's acknowledgements) is measured, and
    memory stays bounded. Returns the messages sent, the seconds and the CPU seconds of this
    process spent in `send` (the client's CPU: the broker is another process), and the bytes
    of the bodies; `stored` is left for the caller to count.
    """
    source = EventSource(config.source)
    mapper = Mapper(OUTBOX, config.outboxes[OUTBOX])
    conn = await asyncpg.connect(config.database.url.get_secret_value())
    result, position = Throughput(0, 0.0), 0
    try:
        while position < last:
            page: Any = await source.read(
                conn, after=position, upto=last, limit=batch, aggregates=None, types=[EVENT_TYPE]
            )
            # (events, cut) since batch.max_bytes; a bare list before, for before/after runs.
            events = page[0] if isinstance(page, tuple) else page
            if not events:
                break
            position = events[-1].position
            messages = []
            for event in events:
                message = mapper.map(event)
                assert message is not None
                messages.append(message)
            chunk = prepare(messages)
            started, cpu_started = time.perf_counter(), time.process_time()
            await send(chunk)
            result.cpu_seconds += time.process_time() - cpu_started
            result.seconds += time.perf_counter() - started
            result.count += len(messages)
            result.body_bytes += sum(len(m.body) for m in messages)
    finally:
        await conn.close()
    return result


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

    With `pipelined`, the reference (the headline's denominator): `batch` `js.publish_async`
    calls, then all their PubAcks awaited, which is how the relay's NATS publisher sends a
    batch. Without, the ceiling, for information: `batch` `js.publish` calls gathered at a
    time, every PubAck awaited (each one a full request, so slower).

    Reading and mapping stay outside the timer (see `timed_publish`). The stream is purged
    first, and every message gets a Nats-Msg-Id of its own (`<id>#<tag>`), so none is dropped
    as a duplicate of an earlier phase's.
    """
    await purge_stream(nats_url, stream_of(config))
    NatsChunk = list[tuple[str, bytes, dict[str, str]]]

    def prepare(messages: list[Message]) -> NatsChunk:
        return [
            (m.destination, m.body, {**message_headers(m), "Nats-Msg-Id": f"{m.id}#{tag}"})
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

        result = await timed_publish(config, last, batch, prepare, send)
    result.stored = await stored_messages(nats_url, stream_of(config))
    return result


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


@dataclass
class Drain:
    """What `drain` saw: wall and CPU seconds, VmRSS at each progress mark, and its peak."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0
    marks: dict[int, int] = field(default_factory=dict)  # progress percent -> VmRSS
    peak_kib: int = 0


async def drain(
    config: RelayConfig,
    conn: asyncpg.Connection,
    last: int,
    timeout: float | None,  # noqa: ASYNC109 - a deadline for the whole drain
) -> Drain:
    """Run the relay until its checkpoint reaches `last`, polling it every POLL seconds.

    The CPU clock is this process's (user + system), read where the wall clock is read: the
    relay runs in this process, Postgres and the broker do not, so it is the relay's CPU, its
    start-up included. This loop runs here too; it takes well under 1% of it (one small query
    and one read of /proc/self/status per 50 ms). The VmRSS sampler is another process.
    """
    result = Drain()
    started, cpu_started = time.perf_counter(), time.process_time()
    async with running(config) as relay:
        tick = started
        while True:
            position = await checkpoint(conn)
            now, cpu, rss = time.perf_counter(), time.process_time(), vmrss_kib()
            result.seconds, result.cpu_seconds = now - started, cpu - cpu_started
            result.peak_kib = max(result.peak_kib, rss)
            for pct in PROGRESS:
                if pct not in result.marks and position * 100 >= last * pct:
                    result.marks[pct] = rss
            if position >= last:
                return result
            if relay.states.get(OUTBOX) and relay.states[OUTBOX].role == "stopped":
                raise RuntimeError("the relay stopped before draining the backlog")
            if timeout is not None and now - started > timeout:
                raise RuntimeError(
                    f"the relay reached position {position} of {last} in {timeout:g}s"
                )
            tick += POLL
            await asyncio.sleep(max(0.0, tick - time.perf_counter()))


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
    trim_heap()
    maxrss_before, vmrss_start = maxrss_kib(), vmrss_kib()
    hwm_reset = reset_peak_rss()
    profiler = cProfile.Profile() if profile else None
    conn = await asyncpg.connect(config.database.url.get_secret_value())
    try:
        if profiler:
            profiler.enable()
        with RssSampler() as sampler:
            run = await drain(config, conn, last, timeout)
        if profiler and profile:
            profiler.disable()
            profiler.dump_stats(profile)
    finally:
        await conn.close()
    hwm = status_kib("VmHWM:") if hwm_reset else 0
    sampled = max(vmrss_start, run.peak_kib, sampler.peak_kib)
    maxrss_after = max(maxrss_before, maxrss_kib())  # the reset lowered ru_maxrss too
    stored = await count_stored()
    return RelayRun(
        throughput=Throughput(last, run.seconds, stored, run.cpu_seconds),
        maxrss_before_kib=maxrss_before,
        maxrss_after_kib=maxrss_after,
        vmrss_start_kib=vmrss_start,
        vmrss_at_kib=run.marks,
        vmrss_peak_kib=max(sampled, hwm),
        stored=stored,
        vmrss_samples=sampler.samples,
        vmrss_max_gap_ms=round(sampler.max_gap * 1000, 1),
        vmrss_late=sampler.late,
        vmrss_sampled_peak_kib=sampled,
        vmhwm_kib=hwm,
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


def rate(t: Throughput, unit: str = "msg") -> str:
    return (
        f"{t.rate:,.0f} {unit}s/s ({t.seconds:.2f}s, {t.cpu_us_per_msg:.1f} µs CPU/{unit}; "
        f"stream holds {t.stored:,})"
    )


def bench_config(args: argparse.Namespace, dsn: str, name: str, **options: Any) -> RelayConfig:
    """The relay's config for this run, with `--batch`, `--payload-bytes` and `--max-bytes`."""
    return relay_config(
        dsn,
        args.nats,
        name,
        batch=args.batch,
        note=args.payload_bytes > 0,
        max_bytes=args.max_bytes,
        schema=schema_for(args.schema),
        **options,
    )


async def bench(args: argparse.Namespace) -> Results:
    configure("warning", "json")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    dsn = with_database(args.pg, name)
    results = Results(
        events=args.events,
        batch=args.batch,
        payload_bytes=args.payload_bytes,
        max_bytes=args.max_bytes,
    )
    try:
        last = await set_up(args, dsn, name, results)
        await throughput_phases(args, dsn, name, last, results)
        if args.latency_seconds > 0:
            await latency_phases(args, dsn, name, last, results)
    finally:
        await cleanup(args, name)
    return results


async def set_up(args: argparse.Namespace, dsn: str, name: str, results: Results) -> int:
    """The database, the stream, the relay's schema and the backlog; the last position."""
    await admin_execute(args.pg, f'CREATE DATABASE "{name}"')
    nats_version = await create_stream(args.nats, name)
    await admin_execute(dsn, read_events_sql())
    config = bench_config(args, dsn, name)
    await migrate_database(Database(config.database, "relay:bench:0"), config)
    results.machine = await machine_info(dsn, nats_version)
    results.machine.update(await nats_limits(args.nats, name, args.payload_bytes))
    say(f"database and stream {name}; inserting {args.events:,} events")
    started = time.perf_counter()
    last = await insert_backlog(dsn, args.events, args.payload_bytes)
    results.insert_seconds = time.perf_counter() - started
    say(f"  inserted in {results.insert_seconds:.1f}s (last position {last})")
    return last


async def nats_limits(url: str, name: str, payload_bytes: int) -> dict[str, str]:
    """The server's max_payload and the stream's max_msg_size; fails early if a message with
    a note of `payload_bytes` (plus 4 KiB for the rest of the body and the headers) would not
    fit, rather than after the backlog is written."""
    async with nats_connection(url) as nc:
        max_payload = nc.max_payload
        info = await nc.jetstream().stream_info(name)
    max_msg_size = info.config.max_msg_size
    limits = [max_payload, *([max_msg_size] if max_msg_size and max_msg_size > 0 else [])]
    if payload_bytes + 4096 > min(limits):
        raise RuntimeError(f"--payload-bytes {payload_bytes} does not fit in NATS: {limits}")
    return {
        "nats-server max_payload": f"{max_payload:,} bytes",
        "stream max_msg_size": "none of its own" if not limits[1:] else f"{max_msg_size:,} bytes",
    }


async def throughput_phases(
    args: argparse.Namespace, dsn: str, name: str, last: int, results: Results
) -> None:
    """Ceiling, reference, relay, reference, ceiling: in mirror order, so that drift on the
    machine affects both sides alike."""
    config = bench_config(args, dsn, name)
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
    say(f"relay: {rate(results.relay.throughput, 'event')}")

    results.pipelined_after = await ceiling(
        config, args.nats, last, args.batch, "p2", pipelined=True
    )
    say(f"reference (after), publish_async pipelined: {rate(results.pipelined_after)}")
    results.ceiling_after = await ceiling(config, args.nats, last, args.batch, "c2")
    say(f"ceiling (after), js.publish x{args.batch} gathered: {rate(results.ceiling_after)}")
    say(
        f"headline, relay / publish_async reference: {results.headline_ratio:.3f} "
        f"(goal >= {HEADLINE_GOAL}); relay / js.publish ceiling, for information: "
        f"{results.ratio:.3f}"
    )
    if args.profile:
        say(f"NOTE: the relay ran under cProfile ({args.profile}): its figures are not valid")


async def latency_phases(
    args: argparse.Namespace, dsn: str, name: str, last: int, results: Results
) -> None:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        for seed, (mode, trigger) in enumerate(
            (("NOTIFY trigger", True), ("polling (1s)", False)), start=1
        ):
            config = bench_config(args, dsn, name, notify_trigger=trigger, poll_interval="1s")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000, help="backlog size")
    parser.add_argument(
        "--batch",
        type=int,
        default=500,
        help="relay batch.max_messages and ceiling gather size (default 500, the relay default)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=0,
        metavar="N",
        help="add a `note` of N ASCII bytes to each backlog event, carried into its message"
        " (default 0: none)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        metavar="N",
        help="set the relay's batch.max_bytes to N (default: not set, the relay's default)",
    )
    parser.add_argument(
        "--schema",
        choices=SCHEMAS,
        default="none",
        help="validate each message against a JSON Schema: draft7 (fastjsonschema) or 2020-12"
        " (jsonschema); default none",
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


def check_options(args: argparse.Namespace) -> None:
    """Fail before anything is created if the relay does not take this run's config (a relay
    without `batch.max_bytes` refuses `--max-bytes`)."""
    try:
        bench_config(args, ADMIN_DSN, "bench_check")
    except ValidationError as exc:
        raise SystemExit(f"relay_bench: the relay refuses this config: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_options(args)
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
