"""The CLI's side of operator commands: hand them to the lease holder, or do them directly.

See control.py for the protocol. A command is written to the commands table and
signalled with NOTIFY; the CLI waits for the holder's recorded outcome. With no
holder, the CLI takes the outbox's lease itself, so two operators (or an
operator and a replica starting up) are serialised by the same lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import structlog

from relay.brokers import create_publisher
from relay.config import RelayConfig
from relay.core.mapping import Mapper
from relay.errors import ConfigError, RelayError, UsageError
from relay.ops.operations import Operations
from relay.postgres.command_queue import CommandQueue
from relay.postgres.database import Database
from relay.postgres.lease import Lease
from relay.postgres.migrations import ensure_migrated
from relay.postgres.source import EventSource
from relay.postgres.sql import quote
from relay.postgres.store import Claim, Store

log = structlog.get_logger("relay.operator")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the CLI reports: who carried the command out, and how it went."""

    ok: bool
    executed_by: str | None
    detail: dict[str, Any]
    direct: bool


class Controller:
    """The CLI's side: hand a command to the holder, or do it under the lease itself."""

    def __init__(self, config: RelayConfig, outbox: str, identity: str) -> None:
        if outbox not in config.outboxes:
            known = ", ".join(sorted(config.outboxes))
            raise ConfigError(f"unknown outbox {outbox!r} (configured: {known})")
        self.config = config
        self.outbox = outbox
        self.identity = identity
        self.db = Database(config.database, identity)
        self.store = Store(config.database.schema_)
        self.source = EventSource(config.source)
        self.queue = CommandQueue(config.database.schema_)

    async def run(self, kind: str, args: dict[str, Any], wait: float) -> Outcome:
        """Do it under the lease if free; else ask its holder, and take over if it leaves."""
        deadline = time.monotonic() + wait
        while True:
            lease = Lease(
                self.db, self.config.lease, self.outbox, self.config.database.schema_, self.identity
            )
            try:
                if await lease.try_acquire():
                    return await self._directly(lease, kind, args)
                outcome = await self._through_holder(lease, kind, args, deadline, wait)
            finally:
                await lease.release()
            if outcome is not None:
                return outcome

    async def _through_holder(
        self, lease: Lease, kind: str, args: dict[str, Any], deadline: float, wait: float
    ) -> Outcome | None:
        """The holder's outcome; None if the lease fell free first (command withdrawn)."""
        conn = await self.db.connect("cli")
        try:
            command_id = await self.queue.submit(conn, self.outbox, kind, args, self.identity)
            while time.monotonic() < deadline:
                result = await self.queue.result(conn, command_id)
                if result["state"] in ("done", "failed"):
                    return Outcome(
                        result["state"] == "done", result["executed_by"], result["outcome"], False
                    )
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

    async def _directly(self, lease: Lease, kind: str, args: dict[str, Any]) -> Outcome:
        """No replica holds the lease: take it, do the work, record it, let go."""
        outbox = self.config.outboxes[self.outbox]
        reader = await self.db.connect("cli")
        publisher = None
        try:
            async with lease.statement() as conn:
                await self.source.check(conn)
                start, start_xmin = await self.source.start_point(conn, outbox.start)
                claim = await self.store.claim(
                    conn, self.outbox, self.identity, start, lease.key, start_xmin=start_xmin
                )
                await self.queue.abandon_running(conn, self.outbox)
            log.info(
                "no holder: carrying out the command under the lease",
                kind=kind,
                outbox=self.outbox,
                epoch=claim.epoch,
            )
            if kind == "retry-parked":
                publisher = create_publisher(outbox.broker, self.config.brokers[outbox.broker])
            operations = Operations(self.store, self.source, Mapper(self.outbox, outbox), publisher)
            ok, detail = await self._under_watch(
                lease,
                claim,
                self._operate(
                    operations, lease=lease, reader=reader, claim=claim, kind=kind, args=args
                ),
            )
            async with lease.statement() as conn:
                command_id = await self.queue.submit(conn, self.outbox, kind, args, self.identity)
                await conn.execute(
                    f"UPDATE {self.queue.table} SET executed_by = $2 WHERE id = $1",
                    command_id,
                    self.identity,
                )
                await self.queue.finish(conn, command_id, ok, detail)
            return Outcome(ok, self.identity, detail, True)
        finally:
            if publisher is not None:
                await publisher.close()
            await reader.close()

    @staticmethod
    async def _operate(
        operations: Operations,
        *,
        lease: Lease,
        reader: asyncpg.Connection,
        claim: Claim,
        kind: str,
        args: dict[str, Any],
    ) -> tuple[bool, dict[str, Any]]:
        try:
            if kind == "replay":
                return True, await operations.replay(lease, claim, int(args["to"]))
            return True, await operations.retry_parked(lease, reader, claim, args.get("ids"))
        except RelayError as exc:
            return False, {"error": str(exc)}

    @staticmethod
    async def _under_watch(
        lease: Lease, claim: Claim, work: Coroutine[Any, Any, tuple[bool, dict[str, Any]]]
    ) -> tuple[bool, dict[str, Any]]:
        """Keep proving the lease (and stamping the heartbeat) while the work runs.

        Without it, a replica starting meanwhile would take this CLI for a silent
        holder after `takeover_after` and end its session.
        """
        working = asyncio.create_task(work)
        watching = asyncio.create_task(lease.watch(claim.epoch))
        try:
            done, _ = await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
            if watching in done:
                working.cancel()
                await asyncio.gather(working, return_exceptions=True)
                raise RelayError(
                    f"lost the lease while carrying out the command: {watching.result()}"
                )
            return working.result()
        finally:
            for task in (working, watching):
                task.cancel()
            await asyncio.gather(working, watching, return_exceptions=True)

    async def replay_target(self, spec: ReplayFrom) -> tuple[int, int]:
        """(the position to move back to, the current checkpoint)."""
        conn = await self.db.connect("cli")
        try:
            await ensure_migrated(conn, self.config.database.schema_)
            current = await conn.fetchval(
                f"SELECT position FROM {quote(self.config.database.schema_)}.checkpoints"
                " WHERE outbox = $1",
                self.outbox,
            )
            if current is None:
                raise CommandRefused(f"outbox {self.outbox!r} has never relayed: nothing to replay")
            if spec.start:
                target = 0
            elif spec.time is not None:
                first = await self.source.first_position_since(conn, spec.time)
                target = current if first is None else first - 1
            else:
                assert spec.position is not None
                target = spec.position - 1
            if target > current:
                raise CommandRefused(
                    f"replay only moves back: position {target + 1} is after the checkpoint"
                    f" ({current}); those events have not been published yet"
                )
            return max(target, 0), int(current)
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


@dataclass(frozen=True, slots=True)
class ReplayFrom:
    position: int | None = None
    start: bool = False
    time: datetime | None = None


class CommandTimeout(RelayError):
    """The holder did not carry out the command in time."""


class CommandRefused(UsageError):
    """The command makes no sense for this outbox (e.g. a replay forwards)."""
