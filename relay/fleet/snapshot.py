"""The whole fleet at one moment, for the status page: `relay status`'s rows read the same way,
with the newest parked messages and the live replicas beside them.

The lanes are `relay status --json`'s rows unchanged (one read, `status.read`), so the page and
the CLI cannot disagree. Free texts are redacted here, once, before anything renders them:
an error may quote a broker's URL with its credentials.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from relay.config import RelayConfig
from relay.fleet import status
from relay.fleet.parked import summary
from relay.fleet.status import OutboxStatus
from relay.postgres.database import KeptConnection
from relay.postgres.membership import Member
from relay.postgres.store import ParkedMessage, Store
from relay.redaction import redact

NEWEST_PARKED = 20
TEXT_CUT = 2000  # characters of a parked message's text the page gets (an id may be 70 KB)


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A live replica, by its heartbeat, with the lanes whose lease its session holds."""

    identity: str
    version: str | None  # None: a release from before replicas recorded theirs
    connected: bool
    holds: list[str]


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    taken_at: datetime  # the database's clock
    lanes: list[OutboxStatus]
    parked: list[ParkedMessage]  # the newest, of every configured outbox
    replicas: list[ReplicaStatus]

    def as_json(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at.isoformat(),
            "lanes": [_redacted(lane.as_json()) for lane in self.lanes],
            "parked_total": sum(lane.parked for lane in self.lanes),
            "parked": [_parked(p) for p in self.parked],
            "replicas": [asdict(r) for r in self.replicas],
        }


async def snapshot(session: KeptConnection, config: RelayConfig) -> FleetSnapshot:
    """One read of the fleet, on the status page's connection."""
    async with session.use() as conn:
        lanes, members = await status.read(conn, config)
        parked = await Store(config.database.schema_).newest_parked(
            conn, [lane.name for lane in lanes], NEWEST_PARKED, TEXT_CUT
        )
        taken_at: datetime = await conn.fetchval("SELECT now()")
    return FleetSnapshot(taken_at, lanes, parked, _replicas(members, lanes))


def _replicas(members: list[Member], lanes: list[OutboxStatus]) -> list[ReplicaStatus]:
    return [
        ReplicaStatus(
            m.identity,
            m.version,
            m.connected,
            [lane.name for lane in lanes if lane.holder == m.identity],
        )
        for m in members
    ]


def _redacted(row: dict[str, Any]) -> dict[str, Any]:
    if row["last_error"] is not None:
        row["last_error"] = redact(row["last_error"])
    audit = row.get("audit")
    if audit is not None and audit["last_error"] is not None:
        row["audit"] = {**audit, "last_error": redact(audit["last_error"])}
    return row


def _parked(p: ParkedMessage) -> dict[str, Any]:
    """`relay parked list --json`'s columns, the error redacted; a NULL a newer release left
    stays null."""
    at = None if p.parked_at is None else p.parked_at.isoformat()
    return {**summary(p), "parked_at": at, "error": None if p.error is None else redact(p.error)}
