"""One lane's relay loop, top to bottom: barrier, read, map, publish, checkpoint, repeat.

A batch's path, in the order of this file: `run` claims nothing (the replica did, and
passes the `Hold`); `_relay` turns the loop; `_next` takes any operator's command first
(`_carry_out_commands`), then the batch read ahead, or a fresh one; `_next_batch` waits
at the barrier for a final prefix of the log and `_read` reads and maps up to a batch of
it (`relay.mapping.mapper.items_of`); the delivery (`relay.core.delivery`) publishes it in
order, retries and parks, reporting through the `CheckpointBehind` at the bottom of this
file; the checkpoint then moves past the batch. A head that went below the checkpoint
halts the lane until an operator's replay.

Two waits overlap with the next batch, without giving up order (the classes at the end):

- `ReadAhead`: batch N+1 is read and mapped while batch N waits for its acknowledgements.
  It is only ever *read*: nothing of N+1 is published before N is fully acknowledged (or
  parked), because the loop hands N+1 to the delivery only after N's delivery returned.
- `CheckpointBehind`: batch N's checkpoint is written while N+1 is being sent. Every later
  write (N+1's checkpoint, a retry report, a parked message) waits for it first, so
  checkpoints land in order, and a write that failed (a lost lease) fails the next one.
  Publishing N+1 before N's checkpoint is stored is at-least-once as ever: if the write
  fails, both are sent again by the next holder, with the same ids.

Both tasks are always awaited: taken, waited for, or cancelled and awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import asyncpg
import structlog

from relay.core.delivery import Delivery, Item, Parking, RetryCount
from relay.core.waiting import sleep_unless, wait_any
from relay.errors import DatabaseError
from relay.mapping.mapper import CompiledRule, items_of
from relay.postgres.claimed import ClaimedOutbox
from relay.postgres.database import CONNECTION_LOST, driver_text
from relay.postgres.replication import OnShort, Standbys
from relay.postgres.source import Blocker
from relay.runtime.commands import fail_stuck
from relay.runtime.context import OutboxContext


@dataclass(frozen=True, slots=True)
class Batch:
    items: list[Item]
    after: int  # the checkpoint it was read from
    upto: int  # every position up to here is handled once `items` are
    full: bool  # more may be ready at once


@dataclass(frozen=True, slots=True)
class Hold:
    """What one uninterrupted hold of the lease relays with."""

    reader: asyncpg.Connection
    claimed: ClaimedOutbox


class OutboxRelay:
    """The holder's loop for one outbox; leases are handled around it (replica.py)."""

    def __init__(self, context: OutboxContext) -> None:
        self.ctx = context
        self.name = context.name
        self.labels = context.lane.labels  # of its metrics
        self.config = context.config
        self.log = structlog.get_logger("relay.outbox").bind(outbox=context.name)
        self.delivery = Delivery(
            context.name,
            context.config,
            publisher=context.publisher,
            metrics=context.metrics,
            state=context.state,
            stop=context.stop,
            interrupt=context.wakes.commands,
            clock_offset=lambda: context.source.clock_offset,
            broker_type=context.relay_config.brokers[context.config.broker].type,
        )
        self._types = list(context.config.messages)
        for rules in context.config.rules(context.name).values():
            for rule in rules:  # at zero from the start, so alerts see the series
                if rule.config.when is not None:
                    context.metrics.skipped.labels(*self.labels, rule.config.type, "when")
        self._horizon = 0
        self._commands_checked = 0.0
        self._stuck_checked = time.monotonic()  # and at the claim (holding.py)
        self._lag_measured = 0.0
        self._pass_started = 0.0  # when the last barrier began: polling keeps its cadence
        self._halted: str | None = None  # set: nothing moves until an operator's replay
        self._standbys_said = 0.0  # when the log last said the standbys were short
        self._standbys_held: str | None = None  # why events are held back, as last said

    async def run(self, hold: Hold) -> None:
        """Relay until `stop`, after the in-flight batch; driver errors become DatabaseError."""
        claim = hold.claimed.claim
        self._horizon = claim.position
        self.delivery.retry, self._halted = claim.retry, claim.halted
        self.ctx.metrics.halted.labels(*self.labels).set(0 if self._halted is None else 1)
        try:
            if claim.start_xmin is not None and not await self._settle_start(hold):
                return
            await self._relay(hold)
        except CONNECTION_LOST as exc:
            raise DatabaseError(f"lost the database connection: {driver_text(exc)}") from exc

    async def _settle_start(self, s: Hold) -> bool:
        """`start: end`, first claim: start before the events of transactions open then.

        The checkpoint was put at the head; once every transaction that held a position
        then has ended, it moves back to just before the first event one of them wrote.
        False if stopped first.
        """
        source, claim = self.ctx.source, s.claimed.claim
        if await source.barrier(s.reader, self._blocked(s), self.ctx.stop) is None:
            return False
        assert claim.start_xmin is not None  # run() checked
        first, whole = await source.first_open_position(s.reader, claim.position, claim.start_xmin)
        start = claim.position if first is None else first - 1
        await s.claimed.settle_start(start)
        # Where the outbox's other lanes start when first claimed (later, perhaps much).
        async with s.claimed.writer.statement() as conn:
            outbox = self.ctx.lane.outbox
            await self.ctx.partitions.settle_start(
                conn, outbox, claim.position if whole is None else whole - 1
            )
        self._horizon = s.claimed.position
        self.ctx.state.moved(s.claimed.position)
        self.log.info(
            "start: end: starting after the events committed before the first start",
            position=s.claimed.position,
            head_at_start=claim.position,
        )
        return True

    async def _relay(self, s: Hold) -> None:
        """Batch after batch; the next is read while one is sent (`ReadAhead`, below)."""
        ahead: ReadAhead[Batch] = ReadAhead()
        checkpoint = CheckpointBehind(
            s.claimed, self.ctx.state.moved, retrying=lambda: self._retrying(s, ahead)
        )
        try:
            while not self.ctx.stop.is_set():
                batch = await self._next(s, checkpoint, ahead)
                if batch is None:  # stopped, halted, or carried out a command
                    continue
                if batch.full and batch.upto < self._horizon:  # final already: no barrier
                    ahead.start(self._read(s, batch.upto))
                if batch.items and not await self.delivery.deliver(checkpoint, batch.items):
                    await ahead.drop()
                    await checkpoint.settled()
                    self._horizon = s.claimed.position  # read again from the checkpoint
                    continue
                if batch.upto > batch.after:
                    if ahead.running:
                        await checkpoint.advance_behind(batch.upto)
                    else:
                        await checkpoint.advance(batch.upto)
                    self.ctx.state.relaying()
                if not batch.full:
                    await self._idle()
            await checkpoint.settled()
        finally:
            await ahead.drop()
            await checkpoint.cancel()

    async def _next(
        self, s: Hold, checkpoint: CheckpointBehind, ahead: ReadAhead[Batch]
    ) -> Batch | None:
        """The batch read ahead, or commands, the halted wait or a fresh read, in turn."""
        if self._commands_due():
            await ahead.settle()  # commands use the reader too
            await checkpoint.settled()
            if await self._carry_out_commands(s):
                await ahead.drop()  # a command moved the checkpoint
            return None
        if self._halted is not None:
            await ahead.drop()
            await checkpoint.settled()
            await self._while_halted(s)
            return None
        if ahead.running:
            return await ahead.take()
        await checkpoint.settled()
        return await self._next_batch(s, s.claimed.position)

    async def _next_batch(self, s: Hold, position: int) -> Batch | None:
        """The next batch to publish; None if stopped or halted meanwhile."""
        source, metrics = self.ctx.source, self.ctx.metrics
        if position >= self._horizon:
            self.ctx.wakes.events.clear()
            self._pass_started = started = time.monotonic()
            horizon = await source.barrier(s.reader, self._blocked(s), self.ctx.stop)
            if horizon is None:
                return None
            metrics.barrier_wait.labels(*self.labels).observe(time.monotonic() - started)
            if horizon < position:
                await self._halt(s, horizon, position)
                return None
            if horizon > position and not await self._replicated(s):
                return None
            self._horizon = horizon
            await self._measure_lag(s, head=horizon)
        return await self._read(s, position)

    async def _replicated(self, s: Hold) -> bool:
        """With `source.survive_failover`: hold what the barrier found final back until
        enough standbys have flushed it (postgres/replication.py); False if stopped."""
        wait = self.ctx.replication
        if wait is None:
            return True
        started = time.monotonic()
        if not await wait.until_flushed(s.reader, self._short_of_standbys(s), self.ctx.stop):
            return False
        self.ctx.metrics.replication_wait.labels(*self.labels).observe(time.monotonic() - started)
        return True

    def _short_of_standbys(self, s: Hold) -> OnShort:
        """Say why events are held back (or go out without standbys): the gauge and the
        lane's state at every look, `relay status` when that changes, the log at most every
        10 s."""
        state = self.ctx.state

        async def report(standbys: Standbys | None) -> None:
            missing = 0 if standbys is None else standbys.missing
            self.ctx.metrics.standbys_missing.labels(*self.labels).set(missing)
            publish = missing > 0 and _without_standbys(self) == "publish"
            held = None if standbys is None or publish else standbys.describe()
            if held is not None:
                state.waiting(held)
            elif state.activity == "waiting":
                state.relaying()
            if held != self._standbys_held:
                await s.claimed.report_standbys(held)
            self._standbys_held = held
            if standbys is None:
                return
            await self._measure_lag(s)  # held back for long, the lag keeps rising
            if time.monotonic() - self._standbys_said < 10.0:
                return
            self._standbys_said = time.monotonic()
            self.log.warning(
                "publishing without the standbys source.survive_failover asks for"
                if publish
                else "holding events back until standbys have them",
                standbys=standbys.describe(),
                waited=round(standbys.waited, 1),
            )

        return report

    async def _read(self, s: Hold, position: int) -> Batch:
        """Up to a batch of the final prefix after `position`, mapped."""
        source, metrics = self.ctx.source, self.ctx.metrics
        if self._horizon <= position:
            return Batch([], position, position, full=False)
        limit = self.config.batch.max_messages
        events, cut = await source.read(
            s.reader,
            after=position,
            upto=self._horizon,
            limit=limit,
            aggregates=self.config.aggregates,
            types=self._types,
            max_bytes=self.config.batch.max_bytes,
            skip=s.claimed.skip,
        )
        mapper, skipped = self.ctx.mapper, self._skipped
        per_event = [items_of(mapper, event, skipped) for event in events]
        items, taken = _within(self.config.batch.max_bytes, per_event)
        metrics.events_read.labels(*self.labels).inc(taken)  # the rest is read again
        full = len(events) == limit or cut or taken < len(events)
        upto = events[taken - 1].position if full and taken else self._horizon
        return Batch(items, position, upto, full=full or upto < self._horizon)

    async def _idle(self) -> None:
        """Wait for a NOTIFY or the next poll, then linger to gather a batch.

        Polls keep a fixed cadence: the interval counts from the start of the last pass,
        not from its end, so an event waits at most one interval (plus the linger). Under
        steady NOTIFYs, passes start at most every `linger`, and an event waits for the pass
        it arrived in to end, not for a whole linger on top.
        """
        ctx = self.ctx
        # A NOTIFY during the pass: its events have been gathering since then, so the
        # linger counts from the pass's start too; from idle it counts from the wake-up.
        during_pass = ctx.wakes.events.is_set()
        ctx.state.idle()
        passed = time.monotonic() - self._pass_started
        await wait_any(
            ctx.stop,
            ctx.wakes.events,
            ctx.wakes.commands,
            within=max(ctx.source.config.poll_interval - passed, 0.0),
        )
        ctx.state.relaying()
        linger = self.config.batch.linger
        if during_pass:
            linger -= time.monotonic() - self._pass_started
        if linger > 0 and not ctx.stop.is_set():
            await sleep_unless(ctx.stop, linger)

    def _commands_due(self) -> bool:
        """An operator's command may be waiting: NOTIFY says so, or polling is due."""
        due = time.monotonic() - self._commands_checked >= self.ctx.source.config.poll_interval
        return due or self.ctx.wakes.commands.is_set()

    async def _carry_out_commands(self, s: Hold) -> bool:
        """Between batches: run operators' commands; True if one moved the checkpoint."""
        self.ctx.wakes.commands.clear()
        self._commands_checked = time.monotonic()
        claim, queue, moved = s.claimed.claim, self.ctx.commands, False
        await self._fail_stuck(s)
        # Asked on the reader: the lease connection is every lane's.
        waiting = await queue.waiting(s.reader, claim.outbox)
        if waiting.stale:  # a newer release's command nobody took: fail it, saying why
            async with s.claimed.writer.statement() as conn:
                failed = await queue.fail_unreadable(conn, claim, self.ctx.identity)
            for command_id, why in failed:
                self.log.warning("command failed", command=command_id, error=why)
        if not waiting.ready:
            return False
        while not (self.ctx.stop.is_set() or self.ctx.shutdown.is_set()):
            async with s.claimed.writer.statement() as conn:
                command = await queue.take(conn, claim, self.ctx.identity)
            if command is None:
                return moved
            log = self.log.bind(command=command.id, kind=command.kind, by=command.requested_by)
            log.info("carrying out command", args=_shortened(command.args))
            done = await self.ctx.command_runner.carry_out(
                command.kind, command.args, s.claimed, s.reader
            )
            if done.moved_to is not None:
                moved = True
                self._horizon = min(self._horizon, done.moved_to)
                self.ctx.state.moved(done.moved_to)
                self._resume_if_halted()
            async with s.claimed.writer.statement() as conn:
                await queue.finish(conn, command.id, done.ok, done.detail)
            log.info("command done" if done.ok else "command failed", outcome=done.detail)
        return moved

    async def _fail_stuck(self, s: Hold) -> None:
        """Now and then, on the first lane's holder: fail the outbox's commands no holder
        will carry out (written by hand for a lane it does not have, say), naming why."""
        lease = self.ctx.relay_config.lease
        if self.ctx.lane.index or time.monotonic() - self._stuck_checked < lease.takeover_after:
            return
        self._stuck_checked = time.monotonic()
        ctx = self.ctx
        await fail_stuck(
            ctx.commands, s.claimed, s.reader, ctx.lane, namespace=lease.namespace, by=ctx.identity
        )

    async def _halt(self, s: Hold, head: int, position: int) -> None:
        """The head went below the checkpoint: the sequence was reset, or the table replaced.

        Relaying on would skip every position up to the old checkpoint without a word, so
        the outbox stops, says so everywhere, and waits for an operator's replay.
        """
        self._halted = (
            f"the event table's head ({head}) is below the checkpoint ({position}): its sequence"
            " was reset or the table was replaced, and relaying on would skip events. Nothing is"
            f" published until an operator decides: `relay replay {self.name} --from-start`"
            f" publishes the table as it is now; `relay replay {self.name} --from {head + 1}`"
            " skips what it holds now"
        )
        await s.claimed.halt(self._halted)
        self.ctx.metrics.halted.labels(*self.labels).set(1)
        self.log.error("outbox halted", reason=self._halted, head=head, checkpoint=position)

    async def _while_halted(self, s: Hold) -> None:
        """Hold the lease and carry out commands (the way out), publishing nothing."""
        assert self._halted is not None  # the loop checked
        self.ctx.state.halted(self._halted)
        wait = self.ctx.source.config.poll_interval
        await wait_any(self.ctx.stop, self.ctx.wakes.commands, within=wait)
        await self._measure_lag(s)

    def _resume_if_halted(self) -> None:
        if self._halted is not None:
            self._halted = None
            self.ctx.metrics.halted.labels(*self.labels).set(0)
            self.ctx.state.resumed()
            self.log.info("outbox resumed by a replay")

    async def _measure_lag(self, s: Hold, head: int | None = None) -> None:
        """Lag and parked gauges, by the database's clock, at most once a second.

        Called after each barrier, while retrying and while the barrier waits, so
        the gauges keep rising when the outbox is stuck.
        """
        now = time.monotonic()
        if now - self._lag_measured < 1.0:
            return
        self._lag_measured = now
        source, metrics, position = self.ctx.source, self.ctx.metrics, s.claimed.position
        if head is None:  # after a barrier the caller knows it; else ask
            head = await source.head(s.reader)
        behind = max(head - position, 0)
        metrics.lag_events.labels(*self.labels).set(behind)
        age = await source.pending_age(s.reader, position) if behind > 0 else 0.0
        metrics.lag_seconds.labels(*self.labels).set(age)
        parked = await self.ctx.store.parked_count(s.reader, s.claimed.claim.outbox)
        if parked is not None:  # None: the table is locked; the gauge keeps its last value
            metrics.parked.labels(*self.labels).set(parked)  # on the reader, not the lease

    def _skipped(self, rule: CompiledRule) -> None:
        self.ctx.metrics.skipped.labels(*self.labels, rule.type, "when").inc()

    def _blocked(self, s: Hold) -> Callable[[Blocker | None], Awaitable[None]]:
        state = self.ctx.state

        async def report(blocker: Blocker | None) -> None:
            already = state.blocked_by
            if blocker is None:
                state.relaying()
                self.log.info("barrier released")
            else:
                state.waiting(blocker.describe())
                if already is None or blocker.waited // 10 != (blocker.waited - 0.25) // 10:
                    self._warn_blocked(blocker)
            if (blocker is None) != (already is None) or already is None:
                await s.claimed.report_blocking(blocker)
            await self._measure_lag(s)

        return report

    def _warn_blocked(self, blocker: Blocker) -> None:
        named = {
            "blocking_pid": blocker.pid,
            "blocking_application": blocker.application_name or None,
            "blocking_gid": blocker.gid,
            "blocking_owner": blocker.owner,
        }
        self.log.warning(
            "waiting for a transaction that holds the event table",
            blocking=blocker.describe(),
            blocking_state=blocker.state,
            waited=round(blocker.waited, 1),
            **{k: v for k, v in named.items() if v is not None},
        )

    async def _retrying(self, s: Hold, ahead: ReadAhead[Batch]) -> None:
        """While the delivery waits to retry, the gauges keep rising (the lag is measured on
        the reader, so the read ahead finishes first)."""
        await ahead.settle()  # the lag is measured on the reader
        await self._measure_lag(s)


def _without_standbys(relay: OutboxRelay) -> str:
    """`source.survive_failover.without_standbys` of the relay's config."""
    survive = relay.ctx.relay_config.source.survive_failover
    return "wait" if survive is None else survive.without_standbys


def _within(max_bytes: int, per_event: list[list[Item]]) -> tuple[list[Item], int]:
    """The items of the first events whose bodies fit in `max_bytes`, and how many events.

    The first event always goes (larger, it goes alone); an event's messages are never
    split between batches, so the checkpoint never moves past one half sent.
    """
    total = 0
    items: list[Item] = []
    for i, event_items in enumerate(per_event):
        for item in event_items:
            total += len(item.message.body) if item.message is not None else 0
        if i and total > max_bytes:
            return items, i
        items += event_items
    return items, len(per_event)


def _shortened(args: object, limit: int = 200) -> str:
    """A command's args for the log: anyone may write a row, with 300,000 ids in it."""
    text = json.dumps(args, default=str)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


# -- The two waits the loop overlaps ---------------------------------------------------------

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """At most one read running beside the publishing; its result is taken or dropped."""

    def __init__(self) -> None:
        self._task: asyncio.Task[T] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self, read: Coroutine[Any, Any, T]) -> None:
        assert self._task is None, "one read ahead at a time"
        self._task = asyncio.create_task(read, name="read ahead")

    async def take(self) -> T:
        """The batch read ahead; its error, if the read failed."""
        task, self._task = self._task, None
        assert task is not None, "nothing was read ahead"
        return await task

    async def settle(self) -> None:
        """Wait until the read is done (its connection is free again), keeping the result."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def drop(self) -> None:
        """Forget the read: the position it started from is no longer the next one.

        A read that failed is not re-raised here: the connection it used fails the next
        statement on it the same way, and that one is not dropped.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class CheckpointBehind:
    """The delivery's `CheckpointWriter`, whose batch checkpoint may be written behind."""

    def __init__(
        self,
        claimed: ClaimedOutbox,
        on_moved: Callable[[int], None],
        *,
        retrying: Callable[[], Awaitable[None]],
    ) -> None:
        self.claimed = claimed
        self.on_moved = on_moved  # the checkpoint is stored at this position
        self.retrying = retrying  # after each retry report: the lane refreshes its gauges
        self._pending: asyncio.Task[None] | None = None

    @property
    def position(self) -> int:
        return self.claimed.position

    async def advance_behind(self, position: int) -> None:
        """Start writing `position`; the next write, of any kind, waits for it."""
        await self.settled()
        self._pending = asyncio.create_task(self._advance(position), name="checkpoint")

    async def settled(self) -> None:
        """Wait for the write behind, if any; raise its error."""
        task, self._pending = self._pending, None
        if task is not None:
            await task

    async def cancel(self) -> None:
        """On the way out after an error or a cancellation: stop the write behind.

        A cancelled statement drops the lease connection (postgres/lease.py), as it would have
        if the write had not been behind.
        """
        task, self._pending = self._pending, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def advance(self, position: int) -> None:
        await self.settled()
        await self._advance(position)

    async def _advance(self, position: int) -> None:
        await self.claimed.advance(position)
        self.on_moved(position)

    async def report(
        self, state: str, last_error: str | None = None, retry: RetryCount | None = None
    ) -> None:
        await self.settled()
        await self.claimed.report(state, last_error, retry)
        if state == "retrying":
            await self.retrying()

    async def park(self, parking: Parking) -> None:
        await self.settled()
        await self.claimed.park(parking)
