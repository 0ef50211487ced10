"""What the one-shot CLI commands do, against the database; the CLI only formats."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from relay.config import RelayConfig
from relay.core.mapping import Event, Mapper
from relay.errors import ConfigError, DatabaseError, MappingError, RelayError
from relay.ops.runner import identity
from relay.postgres.database import Database
from relay.postgres.lease import lock_key
from relay.postgres.migrations import Migrated, OnWait, ensure_migrated
from relay.postgres.migrations import migrate as apply_migrations
from relay.postgres.source import EventSource
from relay.postgres.sql import qualified, quote
from relay.postgres.store import Store
from relay.redaction import redact


@contextlib.asynccontextmanager
async def _connection(config: RelayConfig, role: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection for one command; a driver error inside becomes one DatabaseError line."""
    conn = await Database(config.database, identity()).connect(role)
    try:
        yield conn
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        raise DatabaseError(f"the database failed the command: {redact(str(exc))}") from exc
    finally:
        try:
            await asyncio.wait_for(conn.close(), timeout=2)
        except (OSError, TimeoutError, asyncpg.InterfaceError):
            conn.terminate()


async def migrate(config: RelayConfig, on_wait: OnWait | None = None) -> Migrated:
    async with _connection(config, "migrate") as conn:
        return await apply_migrations(conn, config, on_wait)


async def preview(config: RelayConfig, last: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Map the table's last events as each outbox would, publishing nothing; and warnings."""
    source = EventSource(config.source)
    async with _connection(config, "check") as conn:
        await source.check(conn)
        events = await source.latest(conn, last) if last else []
        warnings = [*config.warnings(), *await _server_warnings(conn, config)]
    mappers = [Mapper(name, outbox) for name, outbox in config.outboxes.items()]
    rows: list[dict[str, Any]] = []
    for event in events:
        for mapper in mappers:
            row: dict[str, Any] = {
                "position": event.position,
                "event": f"{_ref(event)} {event.type}",
                "outbox": mapper.outbox,
            }
            if not mapper.wants(event):
                row["skipped"] = "type not mapped or aggregate filtered out"
            else:
                try:
                    message = mapper.map(event)
                except MappingError as exc:
                    row["parked"] = exc.reason
                    row["error"] = event.problem or str(exc)
                else:
                    assert message is not None
                    row.update(
                        id=message.id,
                        type=message.type,
                        destination=message.destination,
                        key=message.key,
                        body=message.body.decode(),
                    )
            rows.append(row)
    return rows, warnings


async def _server_warnings(conn: asyncpg.Connection, config: RelayConfig) -> list[str]:
    """What the server's settings mean for this config."""
    warnings = []
    prepared = int(await conn.fetchval("SELECT current_setting('max_prepared_transactions')"))
    if config.source.notify_trigger and prepared > 0:
        warnings.append(
            "source.notify_trigger is on and this server allows two-phase commit"
            f" (max_prepared_transactions = {prepared}): a transaction that inserts into"
            f" {config.source.table} runs the trigger's NOTIFY and then cannot PREPARE"
            " TRANSACTION. If the application prepares transactions, set notify_trigger to"
            " false (polling still finds every event)."
        )
    return warnings


def _ref(event: Event) -> str:
    return f"{event.aggregate_type}/{event.aggregate_id}@{event.version}"


async def status(config: RelayConfig) -> list[dict[str, Any]]:
    """One row per configured outbox, computed by the database's clock."""
    source = EventSource(config.source)
    store = Store(config.database.schema_)
    async with _connection(config, "status") as conn:
        await ensure_migrated(conn, config.database.schema_)
        await source.check(conn)
        head = await source.head(conn)
        rows = {r["outbox"]: r for r in await store.checkpoints(conn)}
        standbys = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'relay:%:lease'"
            " AND datname = current_database()"
        )
        out = []
        for name, outbox in config.outboxes.items():
            row = rows.get(name)
            checkpoint = row["position"] if row else None
            # Never relayed: the lag is what the first holder will have to publish.
            since = checkpoint if checkpoint is not None else _first_start(outbox.start, head)
            holder = await _holder(conn, lock_key(config.lease.namespace, name))
            out.append(
                {
                    "name": name,
                    "state": _state(row, holder, standbys),
                    "holder": holder,
                    "epoch": row["epoch"] if row else None,
                    "checkpoint": checkpoint,
                    "head": head,
                    "lag_events": max(head - since, 0),
                    "lag_seconds": await _lag_seconds(conn, config, since),
                    "parked": row["parked"] if row else 0,
                    "last_error": _last_error(row),
                    "blocking_transaction": _blocking(row),
                }
            )
        return out


def _first_start(start: str, head: int) -> int:
    return 0 if start == "beginning" else head


async def _holder(conn: asyncpg.Connection, key: int) -> str | None:
    """The identity of the replica whose session holds the lease, from pg_locks."""
    name = await conn.fetchval(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND ((l.classid::bigint << 32) | l.objid::bigint) = $1::bigint",
        key,
    )
    return None if name is None else str(name).removesuffix(":lease")


def _state(row: dict[str, Any] | None, holder: str | None, standbys: int) -> str:
    if holder is None:
        return "standby only" if standbys else "no holder"
    if row is None:
        return "relaying"
    state = str(row["state"])
    return {"waiting": "waiting on a transaction"}.get(state, state)


def _last_error(row: dict[str, Any] | None) -> str | None:
    if not row or not row["last_error"]:
        return None
    if row["state"] == "retrying":
        return f"attempt {row['attempts']}: {row['last_error']}"
    return str(row["last_error"])


def _blocking(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if not row or not row["blocking"]:
        return None
    value: dict[str, Any] = json.loads(row["blocking"])
    value["age_seconds"] = round(value.pop("transaction_age", 0.0) + row["since_update"], 1)
    return value


async def _lag_seconds(conn: asyncpg.Connection, config: RelayConfig, checkpoint: int) -> float:
    """Age of the oldest event not yet relayed, by the database clock; 0 when caught up."""
    created = config.source.columns.created_at
    if created is None:
        return 0.0
    pos = quote(config.source.columns.position)
    age = await conn.fetchval(
        f"SELECT extract(epoch FROM now() - {quote(created)})::float8 FROM "
        f"{qualified(config.source.table)} WHERE {pos} > $1 ORDER BY {pos} LIMIT 1",
        checkpoint,
    )
    return round(max(age or 0.0, 0.0), 3)


async def parked_list(config: RelayConfig, outbox: str) -> list[dict[str, Any]]:
    _known(config, outbox)
    async with _connection(config, "cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        rows = await Store(config.database.schema_).parked(conn, outbox)
    return [_parked_summary(r) for r in rows]


async def parked_show(config: RelayConfig, id_: int) -> dict[str, Any]:
    async with _connection(config, "cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        row = await Store(config.database.schema_).parked_by_id(conn, id_)
    if row is None:
        raise RelayError(f"no parked message with id {id_}")
    body = row.pop("body")
    row["body"] = body.decode("utf-8", "replace") if body is not None else None
    return row


async def parked_drop(config: RelayConfig, ids: list[int] | None, outbox: str | None) -> list[int]:
    if outbox is not None:
        _known(config, outbox)
    outboxes = [outbox] if outbox else list(config.outboxes)
    async with _connection(config, "cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        return await Store(config.database.schema_).drop_parked(conn, ids, outboxes)


def _parked_summary(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "position": row["position"],
        "event": f"{row['aggregate_type']}/{row['aggregate_id']}@{row['version']}",
        "event_type": row["event_type"],
        "message_id": row["message_id"],
        "reason": row["reason"],
        "attempts": row["attempts"],
        "parked_at": row["parked_at"],
        "error": row["error"],
    }


def _known(config: RelayConfig, outbox: str) -> None:
    if outbox not in config.outboxes:
        known = ", ".join(sorted(config.outboxes))
        raise ConfigError(f"unknown outbox {outbox!r} (configured: {known})")
