"""`relay check`: the event table checked, and the last events mapped as each outbox would.

Nothing is published. Warnings name settings that are legal but costly, or that the
server's own settings make risky.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from relay.config import RelayConfig
from relay.core.mapping import CompiledRule, Event, Mapper
from relay.errors import MalformedEventError, MappingError, SchemaViolation
from relay.ops.identity import identity
from relay.postgres.database import Database
from relay.postgres.source import EventSource


async def preview(config: RelayConfig, last: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Map the table's last events as each outbox would, publishing nothing; and warnings."""
    source = EventSource(config.source)
    async with Database(config.database, identity()).session("check") as conn:
        await source.check(conn)
        events = await source.latest(conn, last) if last else []
        warnings = [*config.warnings(), *await _server_warnings(conn, config)]
    mappers = [Mapper(name, outbox) for name, outbox in config.outboxes.items()]
    rows = [row for event in events for mapper in mappers for row in _preview(event, mapper)]
    return rows, warnings


def _preview(event: Event, mapper: Mapper) -> list[dict[str, Any]]:
    """One row per rule of the event's type (one row when the outbox skips the event)."""
    head: dict[str, Any] = {
        "position": event.position,
        "event": f"{event.aggregate_type}/{event.aggregate_id}@{event.version} {event.type}",
        "outbox": mapper.outbox,
    }
    rules = mapper.rules_for(event)
    if not rules:
        return [{**head, "skipped": "type not mapped or aggregate filtered out"}]
    return [_preview_rule(event, mapper, rule, dict(head)) for rule in rules]


def _preview_rule(
    event: Event, mapper: Mapper, rule: CompiledRule, row: dict[str, Any]
) -> dict[str, Any]:
    if rule.name:
        row["rule"] = rule.name
    try:
        message = mapper.message(event, rule)
    except MappingError as exc:
        row["parked"] = exc.reason
        row["error"] = exc.problem if isinstance(exc, MalformedEventError) else str(exc)
        if isinstance(exc, SchemaViolation):
            row["violations"] = exc.violations
        return row
    if message is None:
        row["skipped"] = f"its condition is false: when: {rule.when_text}"
        return row
    row.update(
        id=message.id,
        type=message.type,
        destination=message.destination,
        key=message.key,
        body=message.body.decode(),
    )
    return row


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
