"""What a bench run relays, and where: a fresh database with the example event table, the
relay's schema and a backlog of BookLent events; a fresh JetStream stream; the relay's config
over both; a run's set-up (with the machine's record) and its clean-up.

`bench/relay_bench.py` builds its run with these, and so do the other benches: the same rows
(`backlog_rows`), the same message (`relay_config`, `schema_for`), the same stream helpers.
`bench/measure.py` times what runs on them. Importing this module has no side effects.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import string
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import nats
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from bench.report import Results, say
from relay.config import RelayConfig
from relay.postgres.database import Database
from relay.postgres.migrations import migrate_database

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
NOTE_ALPHABET = string.ascii_letters + string.digits


# -- the backlog and the relay's config over it -------------------------------------------


def with_database(dsn: str, database: str) -> str:
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{database}"))


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


# -- the database and the stream -----------------------------------------------------------


async def admin_execute(dsn: str, *statements: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


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


# -- a run's set-up and clean-up -----------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """What a run's database, backlog, stream and relay config are made with: the options of
    `relay_bench` that are not its phases' own, with their defaults."""

    events: int = 100_000  # the backlog's size
    batch: int = 500  # the relay's batch.max_messages (its default), the clients' chunk size
    payload_bytes: int = 0  # a `note` of that many ASCII bytes in each event and message
    max_bytes: int | None = None  # the relay's batch.max_bytes (None: left out, its default)
    schema: str = "none"  # the rule's JSON Schema: see schema_for
    pg: str = ADMIN_DSN  # the Postgres server's admin DSN
    nats: str = NATS_URL  # the JetStream server


def bench_config(options: RunOptions, dsn: str, name: str, **settings: Any) -> RelayConfig:
    """The relay's config for this run, with `--batch`, `--payload-bytes` and `--max-bytes`."""
    return relay_config(
        dsn,
        options.nats,
        name,
        batch=options.batch,
        note=options.payload_bytes > 0,
        max_bytes=options.max_bytes,
        schema=schema_for(options.schema),
        **settings,
    )


async def set_up(options: RunOptions, dsn: str, name: str, results: Results) -> int:
    """The database, the stream, the relay's schema and the backlog; the last position."""
    await admin_execute(options.pg, f'CREATE DATABASE "{name}"')
    nats_version = await create_stream(options.nats, name)
    await admin_execute(dsn, read_events_sql())
    config = bench_config(options, dsn, name)
    await migrate_database(Database(config.database, "relay:bench:0"), config)
    results.machine = await machine_info(dsn, nats_version)
    results.machine.update(await nats_limits(options.nats, name, options.payload_bytes))
    say(f"database and stream {name}; inserting {options.events:,} events")
    started = time.perf_counter()
    last = await insert_backlog(dsn, options.events, options.payload_bytes)
    results.insert_seconds = time.perf_counter() - started
    say(f"  inserted in {results.insert_seconds:.1f}s (last position {last})")
    return last


async def cleanup(options: RunOptions, name: str) -> None:
    try:
        await delete_stream(options.nats, name)
    except Exception as exc:  # noqa: BLE001 - clean-up reports and goes on
        say(f"warning: could not delete stream {name}: {exc!r}")
    try:
        await admin_execute(options.pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception as exc:  # noqa: BLE001 - clean-up reports and goes on
        say(f"warning: could not drop database {name}: {exc!r}")


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
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "relay")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (relay/ modified)" if dirty else head


def git(*args: str) -> str:
    """What `git <args>` prints in this tree, stripped."""
    done = subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
    )
    return done.stdout.strip()
