"""Operator commands that must run under an outbox's lease: replay and retry-parked.

The CLI may run anywhere. It writes the command to `<schema>.commands` and
sends NOTIFY; the lease holder carries it out between two batches and records
the outcome, which the CLI waits for. When no replica holds the lease, the CLI
takes the lease itself and does the work directly. A standby never carries
out a command, and the lease serialises two operators' commands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import asyncpg
import structlog

from relay.errors import PublishError, RelayError
from relay.mapping import Mapper
from relay.publishing import Message, Publisher
from relay.source import EventSource
from relay.sql import holds_lock, quote
from relay.store import Claim, Store, Writer

COMMAND_CHANNEL = "relay_commands"

log = structlog.get_logger("relay.control")


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


class Operations:
    """What replay and retry-parked do, given the lease (by the holder or by the CLI)."""

    def __init__(
        self, store: Store, source: EventSource, mapper: Mapper, publisher: Publisher | None
    ) -> None:
        self.store = store
        self.source = source
        self.mapper = mapper
        self.publisher = publisher

    async def replay(self, writer: Writer, claim: Claim, to: int) -> dict[str, Any]:
        """Move the checkpoint back to `to`; events after it are published again."""
        async with writer.statement() as conn:
            previous = await self.store.rewind(conn, claim, to)
        log.info(
            "replay: checkpoint moved back", outbox=claim.outbox, position=to, previous=previous
        )
        return {"checkpoint": to, "previous_checkpoint": previous}

    async def retry_parked(
        self,
        writer: Writer,
        reader: asyncpg.Connection,
        claim: Claim,
        ids: list[int] | None,
    ) -> dict[str, Any]:
        """Map each parked event again with the current config and publish it, in order.

        The lease connection is taken per write, never across a publish, so that the
        lease check is not held up by a slow broker.
        """
        parked = await self.store.parked(reader, claim.outbox, ids)
        unknown = sorted(set(ids or []) - {row["id"] for row in parked})
        events = {
            e.position: e
            for e in await self.source.events_at(reader, [p["position"] for p in parked])
        }
        published: list[int] = []
        failed: dict[int, str] = {}
        for row in parked:
            error = await self._retry_one(row, events.get(row["position"]))
            async with writer.statement() as conn:
                if error is None:
                    await self.store.unpark(conn, claim, row["id"])
                    published.append(row["id"])
                else:
                    await self.store.still_parked(conn, claim, row["id"], str(error), error.reason)
                    failed[row["id"]] = str(error)
        log.info(
            "retry-parked", outbox=claim.outbox, published=len(published), still_parked=len(failed)
        )
        outcome: dict[str, Any] = {
            "retried": len(parked),
            "published": published,
            "still_parked": failed,
        }
        if unknown:
            outcome["not_found"] = unknown
        return outcome

    async def _retry_one(self, row: dict[str, Any], event: Any) -> PublishError | None:
        if event is None:
            return PublishError(f"event at position {row['position']} is no longer in the table")
        try:
            message: Message | None = self.mapper.map(event)
        except PublishError as exc:
            return exc
        if message is None:
            return PublishError("the current config no longer maps this event")
        if self.publisher is None:
            raise RelayError("retry-parked needs the outbox's broker")  # a caller's bug
        (outcome,) = await self.publisher.publish([message])
        return outcome
