"""`relay status`: one row per outbox, from the relay's tables and pg_locks, by the database clock.

It talks to no replica and no broker, so it works from any machine that reaches the
database. The JSON form is a stable interface: exactly the fields of OutboxStatus.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, fields
from typing import Any

import asyncpg

from relay.config import RelayConfig
from relay.core.lanes import lanes_of
from relay.fleet.identity import identity
from relay.postgres.audits import AuditLog, AuditRow
from relay.postgres.command_queue import CommandQueue, Unsettled
from relay.postgres.database import Database
from relay.postgres.lease import holder_identity, lock_key
from relay.postgres.membership import Member, live_members
from relay.postgres.migrations import ensure_migrated
from relay.postgres.partitions import Partitions, mismatch
from relay.postgres.source import EventSource
from relay.postgres.store import CheckpointRow, Store
from relay.printable import printable


@dataclass(frozen=True, slots=True)
class OutboxStatus:
    """One lane: the outbox itself, or `outbox/p` when it is split into partitions."""

    name: str
    partition: int
    state: str
    holder: str | None
    epoch: int | None
    checkpoint: int | None
    head: int
    lag_events: int
    lag_seconds: float
    parked: int
    last_error: str | None
    blocking_transaction: dict[str, Any] | None
    partitions: int  # the outbox's lanes, as it runs (its config's count before the first claim)
    configured_partitions: int  # what this command's config says
    waiting_replicas: list[str]  # why each live replica configured with another count waits
    # The outbox's continuous audit (relay.audits), on its first lane's row; null elsewhere
    # and for an outbox never audited.
    audit: dict[str, Any] | None = None
    # On its first lane's row: the outbox's commands no holder will carry out or finish
    # (stuck), and those that failed in the last 24 h; null elsewhere.
    commands: list[dict[str, Any]] | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# The table shows the lane's own fields; the outbox's (its partitions) are in the summary.
TABLE_COLUMNS = [
    f.name
    for f in fields(OutboxStatus)
    if f.name
    not in (
        "partition",
        "partitions",
        "configured_partitions",
        "waiting_replicas",
        "audit",
        "commands",
    )
]


async def status(config: RelayConfig) -> list[OutboxStatus]:
    """One row per configured outbox."""
    async with Database.of(config, identity()).one_shot("status") as conn:
        return (await read(conn, config))[0]


async def read(
    conn: asyncpg.Connection, config: RelayConfig
) -> tuple[list[OutboxStatus], list[Member]]:
    """The rows of `relay status`, and the live replicas they were read with (the status
    page shows both from one read)."""
    source = EventSource(config.source)  # the whole table: its head and checks
    store = Store(config.database.schema_)
    await ensure_migrated(conn, config.database.schema_)
    await source.check(conn)
    head = await source.head(conn)
    rows = {r.outbox: r for r in await store.checkpoints(conn)}
    standbys = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'relay:%:lease'"
        " AND datname = current_database()"
    )
    members = await live_members(
        conn, config.database.schema_, config.lease.namespace, config.lease.takeover_after
    )
    partitions = Partitions(config.database.schema_)
    audits = {a.outbox: a for a in await AuditLog(config.database.schema_).all(conn)}
    queue = CommandQueue(config.database.schema_)
    unsettled = await queue.unsettled(conn, config.lease.namespace)
    out = []
    for name, outbox in config.outboxes.items():
        record = await partitions.read(conn, name)
        unreadable = record.unreadable if record is not None else None
        count = outbox.partitions if record is None or unreadable else record.partitions
        waiting = [unreadable] if unreadable else []
        waiting += [
            mismatch(name, record, m.outboxes[name], m.identity)
            for m in members
            if record is not None
            and not unreadable
            and name in m.outboxes
            and m.outboxes[name] != count
        ]
        names = [lane.name for lane in lanes_of(name, count)]
        commands = _commands(name, names, unsettled)
        for lane in lanes_of(name, count):
            row = rows.get(lane.name)
            # Never relayed: the lag is what the first holder will have to publish.
            since = row.position if row else (0 if outbox.start == "beginning" else head)
            holder = await holder_identity(conn, lock_key(config.lease.namespace, lane.name))
            lane_source = EventSource(config.source, lane)
            out.append(
                OutboxStatus(
                    name=lane.name,
                    partition=lane.index,
                    state=_state(row, holder, standbys),
                    holder=holder,
                    epoch=row.epoch if row else None,
                    checkpoint=row.position if row else None,
                    head=head,
                    lag_events=max(head - since, 0),
                    lag_seconds=round(await lane_source.pending_age(conn, since), 3),
                    parked=row.parked if row else 0,
                    last_error=_last_error(row),
                    blocking_transaction=_blocking(row),
                    partitions=count,
                    configured_partitions=outbox.partitions,
                    waiting_replicas=waiting,
                    audit=_audit(
                        audits.get(name), lane.index, outbox.audit.enabled, outbox.audit.every
                    ),
                    commands=None if lane.index else commands,
                )
            )
    return out, members


def summary(config: RelayConfig, rows: list[OutboxStatus]) -> list[str]:
    """A line per split outbox: its lanes' states and holders at a glance; and one for any
    outbox that runs with another partition count than a config says."""
    lines = []
    for name in config.outboxes:
        lanes = [r for r in rows if r.name == name or r.name.startswith(f"{name}/")]
        count, configured = lanes[0].partitions, lanes[0].configured_partitions
        if count > 1:
            states = Counter(r.state for r in lanes)
            holders = len({r.holder for r in lanes if r.holder})
            lines.append(
                f"{name}: {count} partitions, "
                + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
                + f"; {holders} replica(s) hold them; lag {max(r.lag_events for r in lanes)}"
                f" events, {max(r.lag_seconds for r in lanes):.1f}s;"
                f" {sum(r.parked for r in lanes)} parked"
            )
        if configured != count:
            lines.append(
                f"{name}: runs with {count} partition(s); this config says {configured}"
                " (docs/scaling.md: changing K)"
            )
        lines += [f"{name}: waiting: {why}" for why in lanes[0].waiting_replicas]
        if lanes[0].audit is not None:
            lines.append(audit_line(name, lanes[0].audit))
        lines += command_lines(name, lanes[0].commands or [])
    return lines


def _commands(outbox: str, lanes: list[str], unsettled: list[Unsettled]) -> list[dict[str, Any]]:
    """The outbox's commands that are stuck (no holder will carry them out or finish them:
    a holder fails them, but none may run) or failed lately; a pending one a holder will
    take, or one running on its holder, is neither."""
    shown = []
    for c in unsettled:
        if c.lane != outbox and not c.lane.startswith(f"{outbox}/"):
            continue
        why = c.stuck(outbox, lanes) if c.state != "failed" else c.error
        if c.state != "failed" and why is None:
            continue
        shown.append(
            {
                "id": c.id,
                "lane": c.lane,
                "kind": c.kind,
                "state": c.state,
                "stuck": c.state != "failed",
                "age_seconds": round(c.age, 1),
                "executed_by": c.executed_by,
                "reason": why,
            }
        )
    # The stuck ones first, oldest first; then the failed ones, newest first.
    return sorted(shown, key=lambda c: (not c["stuck"], c["id"] if c["stuck"] else -c["id"]))


_COMMAND_LINES = 5  # per outbox; `--json` lists them all


def command_lines(name: str, commands: list[dict[str, Any]]) -> list[str]:
    """`relay status`'s lines for an outbox's stuck and lately failed commands."""
    lines = []
    for c in commands[:_COMMAND_LINES]:
        what = f"command {c['id']} ({printable(c['kind'])} of {printable(c['lane'])}, asked"
        what += f" {c['age_seconds']:.0f}s ago)"
        if c["stuck"]:
            lines.append(f"{name}: {what} is stuck {c['state']}: {printable(c['reason'])}")
        else:
            lines.append(f"{name}: {what} failed: {printable(c['reason'] or 'no reason given')}")
    if len(commands) > _COMMAND_LINES:
        more = len(commands) - _COMMAND_LINES
        lines.append(f"{name}: and {more} more command(s) stuck or failed (--json lists them)")
    return lines


STALE_ROUNDS = 5  # rounds with none ended before `relay status` calls the audit stale
STALE_AFTER = 120.0  # seconds, at least


def _audit(row: AuditRow | None, index: int, enabled: bool, every: float) -> dict[str, Any] | None:
    if row is None or index != 0:
        return None
    return {**row.as_json(), "enabled": enabled, "every": every}


def audit_line(name: str, audit: dict[str, Any]) -> str:
    """`relay status`'s line for an outbox's continuous audit."""
    line = (
        f"{name}: audit: checked up to position {audit['position']}"
        f" ({audit['since_audit']:.0f}s ago), {audit['checked']} message(s) checked,"
        f" {audit['missing']} missing"
    )
    if audit["missing"] and audit["last_missing_at"]:
        line += f" (last found {audit['last_missing_at']}"
        shown = audit["last_missing"] or []
        if shown:
            first = shown[0]
            line += f": {first['id']} at position {first['position']} -> {first['destination']}"
        line += ")"
    if audit["last_error"]:
        line += f"; last round failed: {audit['last_error']}"
    if not audit["enabled"]:
        line += "; audit.enabled is off in this config"
    elif audit["since_audit"] > max(STALE_ROUNDS * audit["every"], STALE_AFTER):
        line += (
            "; stale: no round has ended for a while (the holder of its first partition runs"
            " a config without audit.enabled, has no broker to read, or there is no holder)"
        )
    return line


def _state(row: CheckpointRow | None, holder: str | None, standbys: int) -> str:
    if holder is None:
        return "standby only" if standbys else "no holder"
    if row is None:
        return "relaying"
    return {"waiting": "waiting on a transaction"}.get(row.state, row.state)


def _last_error(row: CheckpointRow | None) -> str | None:
    if row is None or not row.last_error:
        return None
    if row.state == "retrying":
        return f"attempt {row.attempts}: {row.last_error}"
    return row.last_error


def _blocking(row: CheckpointRow | None) -> dict[str, Any] | None:
    """The transaction the barrier waits for. A value of another shape (a newer release's,
    docs/upgrading.md) is not shown: nothing but the detail is lost."""
    if row is None or not isinstance(row.blocking, dict) or not row.blocking:
        return None
    value = dict(row.blocking)
    age = value.pop("transaction_age", 0.0)
    if not isinstance(age, int | float) or isinstance(age, bool):
        age = 0.0
    value["age_seconds"] = round(age + row.since_update, 1)
    return value
