"""Operator commands in Postgres: the commands table, written by the CLI, taken by the holder.

The CLI may run anywhere. It writes a command to `<schema>.commands` and sends NOTIFY;
the lease holder takes it between two batches, carries it out and records the outcome,
which the CLI waits for. A standby never takes one: taking needs the outbox's lock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg

from relay.postgres.sql import holds_lock, quote
from relay.postgres.store import Claim

COMMAND_CHANNEL = "relay_commands"


@dataclass(frozen=True, slots=True)
class Command:
    id: int
    outbox: str
    kind: str
    args: dict[str, Any]
    requested_by: str


class CommandQueue:
    """The commands table, seen from the CLI and from the holder."""

    def __init__(self, schema: str) -> None:
        self.table = f"{quote(schema)}.commands"

    async def submit(
        self, conn: asyncpg.Connection, outbox: str, kind: str, args: dict[str, Any], by: str
    ) -> int:
        async with conn.transaction():
            command_id = await conn.fetchval(
                f"INSERT INTO {self.table} (outbox, kind, args, requested_by)"
                " VALUES ($1, $2, $3::jsonb, $4) RETURNING id",
                outbox,
                kind,
                json.dumps(args),
                by,
            )
            await conn.execute("SELECT pg_notify($1, $2)", COMMAND_CHANNEL, outbox)
        return int(command_id)

    async def result(self, conn: asyncpg.Connection, command_id: int) -> dict[str, Any]:
        row = await conn.fetchrow(
            f"SELECT state, executed_by, outcome FROM {self.table} WHERE id = $1", command_id
        )
        out = dict(row)
        out["outcome"] = json.loads(out["outcome"]) if out["outcome"] else None
        return out

    async def expire(self, conn: asyncpg.Connection, command_id: int) -> bool:
        """Withdraw a command nobody took; False if a holder has started it already."""
        status = await conn.execute(
            f"UPDATE {self.table} SET state = 'expired', finished_at = now()"
            " WHERE id = $1 AND state = 'pending'",
            command_id,
        )
        return bool(status.endswith(" 1"))

    async def take(self, conn: asyncpg.Connection, claim: Claim, by: str) -> Command | None:
        """The oldest pending command of the outbox, marked running; holder only."""
        row = await conn.fetchrow(
            f"UPDATE {self.table} SET state = 'running', executed_by = $2 WHERE id = ("
            f" SELECT id FROM {self.table} WHERE outbox = $1 AND state = 'pending'"
            " ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
            f" AND {holds_lock('$3')} RETURNING id, outbox, kind, args, requested_by",
            claim.outbox,
            by,
            claim.key,
        )
        if row is None:
            return None
        return Command(
            row["id"], row["outbox"], row["kind"], json.loads(row["args"]), row["requested_by"]
        )

    async def finish(
        self, conn: asyncpg.Connection, command_id: int, ok: bool, outcome: dict[str, Any]
    ) -> None:
        await conn.execute(
            f"UPDATE {self.table} SET state = $2, outcome = $3::jsonb, finished_at = now()"
            " WHERE id = $1",
            command_id,
            "done" if ok else "failed",
            json.dumps(outcome, default=str),
        )

    async def abandon_running(self, conn: asyncpg.Connection, outbox: str) -> None:
        """A new holder fails what a previous holder left half-done."""
        await conn.execute(
            f"UPDATE {self.table} SET state = 'failed', finished_at = now(),"
            ' outcome = \'{"error": "the holder stopped while carrying it out"}\'::jsonb'
            " WHERE outbox = $1 AND state = 'running'",
            outbox,
        )
