"""The CLI's side of operator commands: hand them to the lease holder, or do them directly.

A command is written to the commands table and signalled with NOTIFY; the CLI waits
for the holder's recorded outcome. With no holder, the CLI takes the outbox's lease
itself and carries the command out with the same steps a replica uses (holding.py,
operations.py), so two operators, or an operator and a replica starting up, are
serialised by the same lock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog

from relay.brokers import create_publisher
from relay.config import RelayConfig
from relay.core.mapping import Mapper
from relay.core.publishing import Publisher
from relay.errors import RelayError, UsageError
from relay.ops import holding
from relay.ops.operations import Done, Operations
from relay.postgres.command_queue import CommandKind, CommandQueue, CommandRequest
from relay.postgres.database import Database
from relay.postgres.lease import Lease
from relay.postgres.migrations import ensure_migrated
from relay.postgres.source import EventSource
from relay.postgres.store import Store

log = structlog.get_logger("relay.operator")


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What the CLI reports: who carried the command out, and how it went."""

    ok: bool
    executed_by: str | None
    detail: dict[str, Any]
    direct: bool  # carried out by the CLI itself: no replica held the lease


@dataclass(frozen=True, slots=True)
class ReplayFrom:
    position: int | None = None
    start: bool = False
    time: datetime | None = None


class CommandTimeout(RelayError):
    """The holder did not carry out the command in time."""


class CommandRefused(UsageError):
    """The command makes no sense for this outbox (e.g. a replay forwards)."""


class Operator:
    """The CLI's side: hand a command to the holder, or do it under the lease itself."""

    def __init__(self, config: RelayConfig, outbox: str, identity: str) -> None:
        config.outbox(outbox)  # unknown: a ConfigError
        self.config = config
        self.outbox = outbox
        self.identity = identity
        self.db = Database(config.database, identity)
        self.store = Store(config.database.schema_)
        self.source = EventSource(config.source)
        self.queue = CommandQueue(config.database.schema_)

    async def run(self, kind: CommandKind, args: dict[str, Any], wait: float) -> CommandResult:
        """Do it under the lease if free; else ask its holder, and take over if it leaves."""
        kind = CommandKind(kind)
        deadline = time.monotonic() + wait
        while True:
            lease = Lease(
                self.db, self.config.lease, self.outbox, self.config.database.schema_, self.identity
            )
            try:
                if await lease.try_acquire():
                    return await self._directly(lease, kind, args)
                result = await self._through_holder(lease, kind, args, deadline, wait)
            finally:
                await lease.release()
            if result is not None:
                return result

    async def _through_holder(
        self,
        lease: Lease,
        kind: CommandKind,
        args: dict[str, Any],
        deadline: float,
        wait: float,
    ) -> CommandResult | None:
        """The holder's outcome; None if the lease fell free first (command withdrawn)."""
        conn = await self.db.connect("cli")
        try:
            request = CommandRequest(self.outbox, kind, args, self.identity)
            command_id = await self.queue.submit(conn, request)
            while time.monotonic() < deadline:
                state = await self.queue.result(conn, command_id)
                if state.finished:
                    ok = state.state == "done"
                    return CommandResult(ok, state.executed_by, state.outcome or {}, False)
                if await lease.holder() is None and await self.queue.expire(conn, command_id):
                    return None  # nobody holds it now: do the work ourselves
                await asyncio.sleep(0.1)
            if await self.queue.expire(conn, command_id):
                raise CommandTimeout(
                    f"no lease holder carried out command {command_id} within {wait:g}s;"
                    " it was withdrawn and nothing was changed"
                )
            raise CommandTimeout(
                f"command {command_id} is still running on the holder after {wait:g}s;"
                " its outcome will be recorded in the commands table"
            )
        finally:
            await conn.close()

    async def _directly(
        self, lease: Lease, kind: CommandKind, args: dict[str, Any]
    ) -> CommandResult:
        """No replica holds the lease: take it, do the work, record it, let go."""
        outbox = self.config.outboxes[self.outbox]
        reader = await self.db.connect("cli")
        publisher: Publisher | None = None
        try:
            claimant = holding.Claimant(
                self.outbox, outbox.start, self.source, self.store, self.queue
            )
            claimed = await holding.claim(lease, claimant)
            log.info(
                "no holder: carrying out the command under the lease",
                kind=kind,
                outbox=self.outbox,
                epoch=claimed.claim.epoch,
            )
            if kind is CommandKind.RETRY_PARKED:
                publisher = create_publisher(outbox.broker, self.config.brokers[outbox.broker])
            operations = Operations(self.store, self.source, Mapper(self.outbox, outbox), publisher)
            # Keep proving the lease (and stamping the heartbeat) while the work runs: else
            # a replica starting meanwhile would take this CLI for a silent holder.
            held = await holding.while_held(
                lease, claimed.claim.epoch, operations.carry_out(kind, args, claimed, reader)
            )
            if held.lost is not None:
                raise RelayError(f"lost the lease while carrying out the command: {held.lost}")
            done = held.result or Done(ok=False)
            async with lease.statement() as conn:
                request = CommandRequest(self.outbox, kind, args, self.identity)
                await self.queue.record(conn, request, ok=done.ok, outcome=done.detail)
            return CommandResult(done.ok, self.identity, done.detail, True)
        finally:
            if publisher is not None:
                await publisher.close()
            await reader.close()

    async def replay_target(self, spec: ReplayFrom) -> tuple[int, int]:
        """(the position to move back to, the current checkpoint)."""
        conn = await self.db.connect("cli")
        try:
            await ensure_migrated(conn, self.config.database.schema_)
            current = await self.store.position(conn, self.outbox)
            if current is None:
                raise CommandRefused(f"outbox {self.outbox!r} has never relayed: nothing to replay")
            if spec.start:
                target = 0
            elif spec.time is not None:
                first = await self.source.first_position_since(conn, spec.time)
                target = current if first is None else first - 1
            else:
                assert spec.position is not None  # the CLI requires one of the three
                target = spec.position - 1
            if target > current:
                raise CommandRefused(
                    f"replay only moves back: position {target + 1} is after the checkpoint"
                    f" ({current}); those events have not been published yet"
                )
            return max(target, 0), current
        finally:
            await conn.close()

    async def count(self, after: int, upto: int) -> int:
        outbox = self.config.outboxes[self.outbox]
        conn = await self.db.connect("cli")
        try:
            return await self.source.count(
                conn,
                after=after,
                upto=upto,
                aggregates=outbox.aggregates,
                types=list(outbox.messages),
            )
        finally:
            await conn.close()
