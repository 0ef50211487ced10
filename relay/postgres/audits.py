"""The continuous audit's row per outbox (`relay.audits`): where it has read the broker back
to, and what it found. Written only by the holder of the outbox's first lane, fenced by that
lane's lock, so that a replica that lost it cannot move the audit's place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay.postgres.queries import statements


@dataclass(frozen=True, slots=True)
class AuditRow:
    """One outbox's continuous audit, as `relay status` shows it."""

    outbox: str
    position: int  # audited up to here
    since_audit: float  # seconds since a round last ended (database clock)
    checked: int  # messages checked so far
    missing: int  # messages found missing so far
    last_missing: list[dict[str, Any]] | None  # the last round's findings, a few of them
    last_missing_at: datetime | None
    last_error: str | None  # why the last round could not finish; None once one did
    auditor: str | None  # the replica that audited last

    def as_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "since_audit": round(self.since_audit, 1),
            "checked": self.checked,
            "missing": self.missing,
            "last_missing": self.last_missing,
            "last_missing_at": None if self.last_missing_at is None else str(self.last_missing_at),
            "last_error": self.last_error,
            "auditor": self.auditor,
        }


class AuditLog:
    """The `audits` statements of own_tables.sql."""

    def __init__(self, schema: str) -> None:
        self.queries = statements("audits", schema)

    async def read(self, conn: asyncpg.Connection, outbox: str) -> AuditRow | None:
        row = await conn.fetchrow(self.queries["read"], outbox)
        return None if row is None else _row(row)

    async def all(self, conn: asyncpg.Connection) -> list[AuditRow]:
        return [_row(r) for r in await conn.fetch(self.queries["all"])]

    async def begin(
        self, conn: asyncpg.Connection, outbox: str, position: int, auditor: str, key: int
    ) -> None:
        """The audit's first place, unless it has one (holder of the first lane only)."""
        await conn.execute(self.queries["begin"], outbox, position, auditor, key)

    async def record(
        self,
        conn: asyncpg.Connection,
        outbox: str,
        position: int,
        *,
        checked: int,
        missing: int,
        examples: list[dict[str, Any]],
        auditor: str,
        key: int,
    ) -> bool:
        """A round done; False when the lock is no longer this connection's (nothing written)."""
        shown = json.dumps(examples) if examples else None
        status = await conn.execute(
            self.queries["record"], outbox, position, checked, missing, shown, auditor, key
        )
        return not status.endswith(" 0")

    async def failed(
        self, conn: asyncpg.Connection, outbox: str, why: str, auditor: str, key: int
    ) -> None:
        await conn.execute(self.queries["failed"], outbox, why, auditor, key)


def _row(row: asyncpg.Record) -> AuditRow:
    shown = row["last_missing"]
    return AuditRow(
        outbox=row["outbox"],
        position=int(row["position"]),
        since_audit=float(row["since_audit"] or 0.0),
        checked=int(row["checked"]),
        missing=int(row["missing"]),
        last_missing=None if shown is None else json.loads(shown),
        last_missing_at=row["last_missing_at"],
        last_error=row["last_error"],
        auditor=row["auditor"],
    )
