"""`relay check`: everything `relay run` would trip on, found before it runs; and the last
events mapped as each outbox would.

It checks the database rights of the role the relay connects as, the event table, the
relay's own tables, and, unless `--offline`, every broker: it connects, logs in, and
looks for each destination it can know in advance. Nothing is published, created or
written. Warnings name settings that are legal but costly, or rights whose absence
only costs a feature.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from relay.brokers import Probing, create_prober, probe_broker
from relay.config import RelayConfig
from relay.core.event import Event
from relay.core.publishing import Message
from relay.errors import (
    ConfigError,
    DatabaseError,
    MalformedEventError,
    MappingError,
    NotMigratedError,
    SchemaViolation,
    SourceError,
)
from relay.fleet.identity import identity
from relay.mapping.expressions import static_text
from relay.mapping.mapper import CompiledRule, Mapper
from relay.postgres.database import Database, too_old
from relay.postgres.migrations import LATEST, ensure_migrated, newer_schema, schema_version
from relay.postgres.partitions import Partitions, mismatch
from relay.postgres.rights import check_rights
from relay.postgres.source import EventSource


@dataclass
class Report:
    """What `relay check` found: problems fail it (exit 1); warnings and notes do not."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The rows that would be sent, with their message and broker: judged by the broker's
    # own rules once it has been probed (some rules need what the server said).
    to_send: list[tuple[dict[str, Any], Message, str]] = field(default_factory=list)


async def run_check(config: RelayConfig, last: int, *, offline: bool = False) -> Report:
    """The database and (unless `offline`) the brokers, side by side."""
    report = Report(warnings=config.warnings())
    publishers = publishers_of(config, report)
    brokers = None if offline else asyncio.gather(*probes(config, publishers))
    try:
        await _database(config, last, report)
    except BaseException:
        if brokers is not None:
            brokers.cancel()
            await asyncio.gather(brokers, return_exceptions=True)
        raise
    if brokers is None:
        report.notes.append("brokers not checked (--offline)")
    else:
        for name, problems in zip(publishers, await brokers, strict=True):
            report.problems += problems
            if not problems:
                report.notes.append(f"broker {name!r}: connected and authenticated")
        report.notes += _run_time_destinations(config)
    _judge_by_broker(report, publishers)
    return report


def _judge_by_broker(report: Report, publishers: dict[str, Probing]) -> None:
    """A message the broker's adapter would refuse before sending is shown as parked, with
    the words `relay run` would park it with."""
    for row, message, broker in report.to_send:
        publisher = publishers.get(broker)
        if publisher is not None and (why := publisher.refusal(message)) is not None:
            row["parked"] = "rejected"
            row["error"] = why


async def _database(config: RelayConfig, last: int, report: Report) -> None:
    source = EventSource(config.source)
    try:
        async with Database.of(config, identity()).one_shot("check") as conn:
            rights = await check_rights(conn, config)
            report.problems += [f"database: {m.describe()}" for m in rights.required]
            report.warnings += [f"database: {m.describe()}" for m in rights.degraded]
            if rights.required:
                return  # the reads below would only fail on the same rights
            try:
                await source.check(conn)
            except SourceError as exc:
                report.problems.append(str(exc))
                return
            report.warnings += await source.warnings(conn)
            if (why := too_old(conn)) is not None:
                report.problems.append(why)
            await _migration_state(conn, config, report)
            events = await source.latest(conn, last) if last else []
            report.warnings += await _server_warnings(conn, config)
    except DatabaseError as exc:
        report.problems.append(str(exc))
        return
    mappers = [(Mapper(name, outbox), outbox.broker) for name, outbox in config.outboxes.items()]
    for event in events:
        for mapper, broker in mappers:
            for row, message in _preview(event, mapper):
                report.rows.append(row)
                if message is not None:
                    report.to_send.append((row, message, broker))


async def _migration_state(conn: asyncpg.Connection, config: RelayConfig, report: Report) -> None:
    """What `relay run` would refuse in the relay's own tables. Not migrated yet is only a
    warning here (migrate may come next); tables newer than this relay are a problem. An
    outbox that runs with another partition count than the config's is a warning: replicas
    with this config wait, or change it over (docs/scaling.md)."""
    schema = config.database.schema_
    version = await schema_version(conn, schema)
    if version < LATEST:
        report.warnings.append(
            f"the relay's tables in schema {schema!r} are at version {version} of {LATEST}:"
            " `relay run` refuses to start until `relay migrate` has run"
        )
        return
    try:
        await ensure_migrated(conn, schema)
    except NotMigratedError as exc:
        report.problems.append(str(exc))
        return
    if (newer := newer_schema(schema, version)) is not None:
        report.warnings.append(newer)
    partitions = Partitions(schema)
    for name, outbox in config.outboxes.items():
        record = await partitions.read(conn, name)
        if record is not None and record.partitions != outbox.partitions:
            report.warnings.append(mismatch(name, record, outbox.partitions))


def publishers_of(config: RelayConfig, report: Report) -> dict[str, Probing]:
    """Every configured broker's adapter; one that cannot be built at all (its client
    library missing) is a problem instead."""
    publishers = {}
    for name, broker in config.brokers.items():
        try:
            publishers[name] = create_prober(name, broker)
        except ConfigError as exc:
            report.problems.append(str(exc))
    return publishers


def probes(config: RelayConfig, publishers: dict[str, Probing]) -> Iterator[Any]:
    """One probe per broker, with the destinations known in advance."""
    for name, publisher in publishers.items():
        yield probe_broker(publisher, sorted(set(_fixed_destinations(config, name))))


def _fixed_destinations(config: RelayConfig, broker: str) -> Iterator[str]:
    for name, outbox in config.outboxes.items():
        if outbox.broker == broker:
            for rules in outbox.rules(name).values():
                for rule in rules:
                    if (fixed := static_text(rule.config.destination)) is not None:
                        yield fixed


def _run_time_destinations(config: RelayConfig) -> list[str]:
    return [
        f"{rule.where}.destination {rule.config.destination!r} depends on"
        " the event: checked at run time"
        for name, outbox in config.outboxes.items()
        for rules in outbox.rules(name).values()
        for rule in rules
        if static_text(rule.config.destination) is None
    ]


Preview = tuple[dict[str, Any], Message | None]  # a row, and the message it would send


def _preview(event: Event, mapper: Mapper) -> list[Preview]:
    """One row per rule of the event's type (one row when the outbox skips the event)."""
    head: dict[str, Any] = {
        "position": event.position,
        "event": f"{event.aggregate_type}/{event.aggregate_id}@{event.version} {event.type}",
        "outbox": mapper.outbox,
    }
    rules = mapper.rules_for(event)
    if not rules:
        return [({**head, "skipped": "type not mapped or aggregate filtered out"}, None)]
    return [_preview_rule(event, mapper, rule, dict(head)) for rule in rules]


def _preview_rule(event: Event, mapper: Mapper, rule: CompiledRule, row: dict[str, Any]) -> Preview:
    if rule.name:
        row["rule"] = rule.name
    try:
        message = mapper.message(event, rule)
    except MappingError as exc:
        row["parked"] = exc.reason
        row["error"] = exc.problem if isinstance(exc, MalformedEventError) else str(exc)
        if isinstance(exc, SchemaViolation):
            row["violations"] = exc.violations
        return row, None
    if message is None:
        row["skipped"] = f"its condition is false: when: {rule.when_text}"
        return row, None
    row.update(
        id=message.id,
        type=message.type,
        destination=message.destination,
        key=message.key,
        body=message.body.decode(),
    )
    return row, message


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
