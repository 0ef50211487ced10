"""The relay's own tables: checkpoints, parked messages and reported state.

Every write that moves an outbox is conditional on three things: the epoch
the writer claimed, that the writing connection holds the outbox's advisory
lock, and that the checkpoint moves forwards. A write that matches no row
means this replica has been fenced: FencedError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay.core.delivery import Parking, RetryCount
from relay.core.event import Event
from relay.core.publishing import Message
from relay.errors import FencedError
from relay.postgres.queries import lock_wait, statements
from relay.postgres.skipping import Skip, skip_of
from relay.postgres.source import Blocker

# Seconds a gauge's read of relay.parked waits for a lock another session holds.
GAUGE_LOCK_WAIT = 0.1


@dataclass(frozen=True, slots=True)
class Claim:
    """What a replica holds after claiming an outbox under its lease."""

    outbox: str
    epoch: int
    position: int
    key: int  # the lease's advisory lock; every write proves it is still held
    halted: str | None = None  # why the outbox must not move until an operator acts
    retry: RetryCount | None = None
    start_xmin: int | None = None  # `start: end` not settled yet: see EventSource.start_point
    broker: str | None = None  # the broker's identity, written with each checkpoint
    recorded_broker: str | None = None  # the one the checkpoint was last written for
    skip: Skip | None = None  # made by a repartition: what the old lanes had published
    skip_unreadable: bool = False  # the row's skip is a newer release's: read as none


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """One outbox's row of the checkpoints table, as `relay status` reads it."""

    outbox: str
    position: int
    epoch: int
    holder: str | None
    state: str
    attempts: int
    last_error: str | None
    blocking: dict[str, Any] | None
    since_update: float  # seconds since the row last changed, by the database clock
    parked: int


@dataclass(frozen=True, slots=True)
class ParkedMessage:
    """A message set aside; the event's fields may be NULL when the row was malformed.

    This release writes every row with a rule, a reason, an error, its attempts and when.
    A newer one may leave them NULL or write a reason this one does not know
    (docs/upgrading.md): they are read and shown as they are."""

    id: int
    outbox: str
    position: int
    event_type: str | None
    aggregate_type: str | None
    aggregate_id: str | None
    version: int | None
    message_id: str | None
    message_type: str | None
    destination: str | None
    message_key: str | None
    body: bytes | None
    rule: str | None  # which of the event type's rules ("" for the single-rule form)
    reason: str | None
    error: str | None
    attempts: int | None
    parked_at: datetime | None

    @property
    def event(self) -> str:
        return f"{self.aggregate_type}/{self.aggregate_id}@{self.version}"


class Store:
    def __init__(self, schema: str) -> None:
        self.queries = statements("store", schema)

    async def claim(
        self,
        conn: asyncpg.Connection,
        outbox: str,
        holder: str,
        start: int,
        key: int,
        *,
        start_xmin: int | None = None,
        broker: str | None = None,
    ) -> Claim:
        """Take the next epoch, on the connection holding lock `key`; create the row if new.

        `start` (and `start_xmin`) only matter for a new row; an existing row keeps its own.
        `broker` is recorded with each checkpoint written under this claim; the claim says
        which broker the row was last written for.
        """
        await conn.execute(self.queries["create_checkpoint"], outbox, start, start_xmin, broker)
        row = await conn.fetchrow(self.queries["claim"], outbox, holder, key)
        if row is None:
            raise FencedError(f"outbox {outbox!r}: cannot claim it without holding its lease")
        retry = None
        if row["retry_position"] is not None:
            retry = RetryCount(
                row["retry_position"], row["attempts"], row["rejections"], row["retry_rule"]
            )
        skip, unreadable = skip_of(row["skip"])
        skip = None if skip is None else skip.past(row["position"])
        return Claim(
            outbox,
            row["epoch"],
            row["position"],
            key,
            row["halted"],
            retry,
            row["start_xmin"],
            broker,
            row["broker"],
            skip,
            unreadable,
        )

    async def _fenced(
        self,
        conn: asyncpg.Connection,
        claim: Claim,
        action: str,
        statement: str,
        *values: object,
    ) -> None:
        """Run one of the fenced writes (own_tables.sql says how) under `claim`, `values` from $4;
        FencedError naming `action` if it matched no row."""
        status = await conn.execute(statement, claim.outbox, claim.epoch, claim.key, *values)
        _fenced_unless_updated(status, claim, action)

    async def advance(self, conn: asyncpg.Connection, claim: Claim, position: int) -> None:
        """Move the checkpoint forwards and mark the outbox healthy."""
        action = f"moving the checkpoint to {position}"
        await self._fenced(conn, claim, action, self.queries["advance"], position, claim.broker)

    async def rewind(self, conn: asyncpg.Connection, claim: Claim, position: int) -> int:
        """Move the checkpoint back, for `relay replay` only; returns where it was."""
        previous = await conn.fetchval(
            self.queries["rewind"],
            claim.outbox,
            claim.epoch,
            position,
            claim.key,
            claim.broker,
        )
        if previous is None:
            raise FencedError(
                f"outbox {claim.outbox!r}: replay to {position} refused: this replica lost the"
                " lease, or the checkpoint is already before that position"
            )
        return int(previous)

    async def report(
        self,
        conn: asyncpg.Connection,
        claim: Claim,
        state: str,
        attempts: int = 0,
        last_error: str | None = None,
        *,
        retry: RetryCount | None = None,
    ) -> None:
        """Record the outbox's state (relaying, retrying, stopped) for `relay status`."""
        await self._fenced(
            conn,
            claim,
            f"reporting state {state}",
            self.queries["report"],
            state,
            attempts,
            last_error,
            retry.position if retry else None,
            retry.rejections if retry else 0,
            retry.rule if retry else "",
        )

    async def halt(self, conn: asyncpg.Connection, claim: Claim, reason: str) -> None:
        """Stop the outbox until an operator's replay: it stays halted across restarts."""
        await self._fenced(conn, claim, "halting the outbox", self.queries["halt"], reason)

    async def settle_start(self, conn: asyncpg.Connection, claim: Claim, position: int) -> None:
        """`start: end`: put the first checkpoint where the first open transaction's events are."""
        action = f"settling the starting position at {position}"
        await self._fenced(conn, claim, action, self.queries["settle_start"], position)

    async def report_blocking(
        self, conn: asyncpg.Connection, claim: Claim, blocker: Blocker | None
    ) -> None:
        """Name the transaction the barrier waits for, or clear it."""
        value = None
        if blocker is not None:
            value = json.dumps(
                {**blocker.fields(), "transaction_age": round(blocker.transaction_age, 3)}
            )
        await self._fenced(
            conn,
            claim,
            "reporting a blocking transaction",
            self.queries["report_blocking"],
            value,
        )

    async def report_standbys(
        self, conn: asyncpg.Connection, claim: Claim, held: str | None
    ) -> None:
        """Say why events are held back until standbys have them (source.survive_failover),
        or that they no longer are."""
        await self._fenced(
            conn, claim, "reporting the standbys", self.queries["report_standbys"], held
        )

    async def park(self, conn: asyncpg.Connection, claim: Claim, parking: Parking) -> None:
        """Keep the message aside and move to `parking.upto`, in one transaction.

        `upto` stays before the event while another of its messages is still to be sent.
        """
        event = parking.event
        async with conn.transaction():
            await conn.execute(
                self.queries["park"],
                claim.outbox,
                event.position,
                event.type,
                event.aggregate_type,
                event.aggregate_id,
                event.version,
                *_message_columns(parking.message),
                parking.reason,
                parking.error,
                parking.attempts,
                parking.rule,
            )
            await self.advance(conn, claim, parking.upto)

    async def checkpoints(self, conn: asyncpg.Connection) -> list[CheckpointRow]:
        rows = await conn.fetch(self.queries["checkpoints"])
        return [
            CheckpointRow(
                **{**dict(r), "blocking": json.loads(r["blocking"]) if r["blocking"] else None}
            )
            for r in rows
        ]

    async def position(self, conn: asyncpg.Connection, outbox: str) -> int | None:
        """The outbox's checkpoint; None before its first claim."""
        value = await conn.fetchval(self.queries["position"], outbox)
        return None if value is None else int(value)

    async def parked(
        self, conn: asyncpg.Connection, lanes: str | list[str], ids: list[int] | None = None
    ) -> list[ParkedMessage]:
        """Parked messages of these lanes in position order; only `ids` when given."""
        chosen = [lanes] if isinstance(lanes, str) else lanes
        rows = await conn.fetch(self.queries["parked"], chosen, ids)
        return [ParkedMessage(**dict(r)) for r in rows]

    async def parked_attempts(
        self, conn: asyncpg.Connection, lanes: list[str], ids: list[int] | None = None
    ) -> dict[int, int]:
        """Each parked message's attempts so far (of these lanes; only `ids` when given)."""
        rows = await conn.fetch(self.queries["parked_attempts"], lanes, ids)
        return {r["id"]: r["attempts"] for r in rows}

    async def newest_parked(
        self, conn: asyncpg.Connection, lanes: list[str], limit: int, cut: int
    ) -> list[ParkedMessage]:
        """The `limit` last parked of these lanes, newest first, without bodies, each text cut
        to `cut` characters and `…` (`relay parked show` shows it whole)."""
        rows = await conn.fetch(self.queries["newest_parked"], lanes, limit, cut)
        return [ParkedMessage(**dict(r)) for r in rows]

    async def parked_by_id(self, conn: asyncpg.Connection, id_: int) -> ParkedMessage | None:
        row = await conn.fetchrow(self.queries["parked_by_id"], id_)
        return ParkedMessage(**dict(row)) if row else None

    async def parked_lanes(
        self, conn: asyncpg.Connection, lanes: list[str], ids: list[int]
    ) -> dict[int, str]:
        """Which of `lanes` parked each of these messages (ids of other outboxes are left out)."""
        rows = await conn.fetch(self.queries["parked_lanes"], ids, lanes)
        return {int(r["id"]): str(r["outbox"]) for r in rows}

    async def parked_count(self, conn: asyncpg.Connection, outbox: str) -> int | None:
        """For the gauge: None when the table is locked by another session (a `LOCK TABLE`,
        a backup, a migration) for longer than GAUGE_LOCK_WAIT. The holder reads it on the
        loop that delivers, and waited behind such a lock: the lane stalled for a gauge."""
        try:
            async with conn.transaction(readonly=True):
                await conn.execute(lock_wait(GAUGE_LOCK_WAIT))
                return int(await conn.fetchval(self.queries["parked_count"], outbox))
        except asyncpg.LockNotAvailableError:
            return None

    async def parked_keys(
        self, conn: asyncpg.Connection, lanes: list[str], after: int, upto: int
    ) -> dict[tuple[str, int, str], str]:
        """(lane, position, rule) of what these lanes parked in (after, upto], and why."""
        rows = await conn.fetch(self.queries["parked_keys"], lanes, after, upto)
        return {(str(r["outbox"]), int(r["position"]), str(r["rule"])): r["reason"] for r in rows}

    async def park_missing(
        self,
        conn: asyncpg.Connection,
        lane: str,
        event: Event,
        message: Message,
        *,
        rule: str,
        error: str,
    ) -> int:
        """Park a message an audit found missing from its broker (reason `missing`), so that
        retry-parked publishes it again; its parked id (a row already there keeps its own)."""
        return int(
            await conn.fetchval(
                self.queries["park_missing"],
                lane,
                event.position,
                event.type,
                event.aggregate_type,
                event.aggregate_id,
                event.version,
                *_message_columns(message),
                error,
                rule,
            )
        )

    async def drop_parked(
        self, conn: asyncpg.Connection, ids: list[int] | None, outboxes: list[str]
    ) -> list[int]:
        """Delete parked messages by id, or all of `outboxes` when `ids` is None."""
        rows = await conn.fetch(self.queries["drop_parked"], ids, outboxes)
        return sorted(r["id"] for r in rows)

    async def unpark(self, conn: asyncpg.Connection, claim: Claim, ids: list[int]) -> None:
        """These parked messages were published: forget them (holder only)."""
        await conn.execute(self.queries["unpark"], ids, claim.outbox, claim.key)

    async def still_parked(
        self, conn: asyncpg.Connection, claim: Claim, failed: dict[int, tuple[str, str]]
    ) -> None:
        """These parked messages failed again: one more attempt, their new error and reason
        (`failed` maps each id to them), in one statement (holder only)."""
        ids = list(failed)
        await conn.execute(
            self.queries["still_parked"],
            ids,
            [failed[i][0] for i in ids],
            [failed[i][1] for i in ids],
            claim.outbox,
            claim.key,
        )


def _message_columns(message: Message | None) -> tuple[Any, ...]:
    if message is None:
        return (None, None, None, None, None)
    return (message.id, message.type, message.destination, message.key, message.body)


def _fenced_unless_updated(status: str, claim: Claim, action: str) -> None:
    if status.endswith(" 0"):
        raise FencedError(
            f"outbox {claim.outbox!r}: {action} matched no row at epoch {claim.epoch}; "
            "this replica lost the lease, another one claimed the outbox since, or the"
            " checkpoint would move backwards"
        )
