"""The relay's own tables: checkpoints, parked messages and reported state.

Every write that moves an outbox is conditional on the epoch that the writer
claimed, and the checkpoint can only move forwards. A write that matches no
row means another replica has claimed the outbox since: FencedError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from relay.errors import FencedError
from relay.mapping import Event
from relay.publishing import Message
from relay.source import Blocker
from relay.sql import quote


@dataclass(frozen=True, slots=True)
class Claim:
    """What a replica holds after claiming an outbox."""

    outbox: str
    epoch: int
    position: int


class Store:
    def __init__(self, schema: str) -> None:
        s = quote(schema)
        self._checkpoints = f"{s}.checkpoints"
        self._parked = f"{s}.parked"

    async def claim(self, conn: asyncpg.Connection, outbox: str, holder: str, start: int) -> Claim:
        """Create the outbox's row at `start` if new, and take the next epoch."""
        row = await conn.fetchrow(
            f"INSERT INTO {self._checkpoints} AS c"
            " (outbox, position, epoch, holder, held_since, state)"
            " VALUES ($1, $2, 1, $3, now(), 'relaying')"
            " ON CONFLICT (outbox) DO UPDATE SET epoch = c.epoch + 1, holder = $3,"
            " held_since = now(), state = 'relaying', attempts = 0, last_error = NULL,"
            " blocking = NULL, updated_at = now()"
            " RETURNING epoch, position",
            outbox,
            start,
            holder,
        )
        return Claim(outbox, row["epoch"], row["position"])

    async def exists(self, conn: asyncpg.Connection, outbox: str) -> bool:
        return bool(
            await conn.fetchval(f"SELECT true FROM {self._checkpoints} WHERE outbox = $1", outbox)
        )

    async def advance(self, conn: asyncpg.Connection, claim: Claim, position: int) -> None:
        """Move the checkpoint forwards and mark the outbox healthy."""
        status = await conn.execute(
            f"UPDATE {self._checkpoints} SET position = $3, state = 'relaying', attempts = 0,"
            " last_error = NULL, updated_at = now()"
            " WHERE outbox = $1 AND epoch = $2 AND position <= $3",
            claim.outbox,
            claim.epoch,
            position,
        )
        _fenced_unless_updated(status, claim, f"moving the checkpoint to {position}")

    async def report(
        self,
        conn: asyncpg.Connection,
        claim: Claim,
        state: str,
        attempts: int = 0,
        last_error: str | None = None,
    ) -> None:
        """Record the outbox's state (relaying, retrying, stopped) for `relay status`."""
        status = await conn.execute(
            f"UPDATE {self._checkpoints} SET state = $3, attempts = $4, last_error = $5,"
            " updated_at = now() WHERE outbox = $1 AND epoch = $2",
            claim.outbox,
            claim.epoch,
            state,
            attempts,
            last_error,
        )
        _fenced_unless_updated(status, claim, f"reporting state {state}")

    async def report_blocking(
        self, conn: asyncpg.Connection, claim: Claim, blocker: Blocker | None
    ) -> None:
        """Name the transaction the barrier waits for, or clear it."""
        value = None
        if blocker is not None:
            value = json.dumps(
                {
                    "pid": blocker.pid,
                    "application_name": blocker.application_name,
                    "state": blocker.state,
                    "transaction_age": round(blocker.transaction_age, 3),
                }
            )
        status = await conn.execute(
            f"UPDATE {self._checkpoints} SET blocking = $3::jsonb,"
            " state = CASE WHEN $3::jsonb IS NULL THEN 'relaying' ELSE 'waiting' END,"
            " updated_at = CASE WHEN $3::jsonb IS NULL OR blocking IS NULL THEN now()"
            " ELSE updated_at END"
            " WHERE outbox = $1 AND epoch = $2",
            claim.outbox,
            claim.epoch,
            value,
        )
        _fenced_unless_updated(status, claim, "reporting a blocking transaction")

    async def park(
        self,
        *,
        conn: asyncpg.Connection,
        claim: Claim,
        event: Event,
        message: Message | None,
        reason: str,
        error: str,
        attempts: int,
    ) -> None:
        """Keep the message aside and move past it, in one transaction."""
        async with conn.transaction():
            await conn.execute(
                f"INSERT INTO {self._parked} (outbox, position, event_type, aggregate_type,"
                " aggregate_id, version, message_id, message_type, destination, message_key, body,"
                " reason, error, attempts) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14)"
                " ON CONFLICT (outbox, position) DO UPDATE SET attempts = excluded.attempts,"
                " error = excluded.error, reason = excluded.reason, parked_at = now()",
                claim.outbox,
                event.position,
                event.type,
                event.aggregate_type,
                event.aggregate_id,
                event.version,
                *_message_columns(message),
                reason,
                error,
                attempts,
            )
            await self.advance(conn, claim, event.position)

    async def checkpoints(self, conn: asyncpg.Connection) -> list[dict[str, Any]]:
        rows = await conn.fetch(
            f"SELECT c.*, extract(epoch FROM now() - c.updated_at)::float8 AS since_update,"
            f" (SELECT count(*) FROM {self._parked} p WHERE p.outbox = c.outbox) AS parked"
            f" FROM {self._checkpoints} c ORDER BY outbox"
        )
        return [dict(r) for r in rows]

    async def parked(self, conn: asyncpg.Connection, outbox: str) -> list[dict[str, Any]]:
        rows = await conn.fetch(
            f"SELECT * FROM {self._parked} WHERE outbox = $1 ORDER BY position", outbox
        )
        return [dict(r) for r in rows]


def _message_columns(message: Message | None) -> tuple[Any, ...]:
    if message is None:
        return (None, None, None, None, None)
    return (message.id, message.type, message.destination, message.key, message.body)


def _fenced_unless_updated(status: str, claim: Claim, action: str) -> None:
    if status.endswith(" 0"):
        raise FencedError(
            f"outbox {claim.outbox!r}: {action} matched no row at epoch {claim.epoch}; "
            "another replica has claimed this outbox, or the checkpoint would move backwards"
        )
