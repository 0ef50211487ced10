"""One outbox's relay loop: barrier, read, map, publish, checkpoint, repeat.

The loop is deliberately plain. Each turn makes a prefix of the log final,
reads up to a batch of it, publishes the mapped messages in position order
and, once the broker has acknowledged them, moves the checkpoint. A failed
batch is retried, with backoff, before anything after it; only a message the
broker rejects for good (or that cannot be mapped) is parked, after
`park_after` attempts, so that the rest can flow.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg
import structlog

from relay.config import OutboxConfig
from relay.core.mapping import Event, Mapper
from relay.core.metrics import Metrics
from relay.core.publishing import Message, Publisher
from relay.core.retry import Backoff
from relay.core.state import OutboxState
from relay.core.waiting import sleep_unless, wait_any
from relay.errors import (
    DatabaseError,
    MappingError,
    PublishError,
    RelayError,
    TransientPublishError,
)
from relay.ops.operations import Operations
from relay.postgres.command_queue import CommandQueue
from relay.postgres.source import Blocker, EventSource
from relay.postgres.store import ClaimedOutbox, RetryCount, Store

# Driver errors that mean "the database went away": retry, never crash.
DB_ERRORS = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.InternalClientError,  # a connection left mid-operation by a cancelled statement
)


@dataclass(frozen=True, slots=True)
class Item:
    """An event to publish: its message, or why it could not be mapped."""

    event: Event
    message: Message | None
    error: MappingError | None


@dataclass(frozen=True, slots=True)
class Batch:
    items: list[Item]
    upto: int  # every position up to here is handled once `items` are
    full: bool  # more may be ready at once


@dataclass
class Session:
    """What one uninterrupted hold of the lease relays with."""

    reader: asyncpg.Connection
    checkpoint: ClaimedOutbox

    @property
    def position(self) -> int:
        return self.checkpoint.claim.position


class OutboxRelay:
    """The holder's loop for one outbox; leases are handled around it (replica.py)."""

    def __init__(
        self,
        name: str,
        config: OutboxConfig,
        *,
        source: EventSource,
        publisher: Publisher,
        state: OutboxState,
        wake: asyncio.Event,
        stop: asyncio.Event,
        store: Store,
        commands: CommandQueue,
        command_wake: asyncio.Event,
        identity: str,
        metrics: Metrics,
    ) -> None:
        self.name = name
        self.config = config
        self.source = source
        self.mapper = Mapper(name, config)
        self.publisher = publisher
        self.state = state
        self.wake = wake
        self.stop = stop
        self.log = structlog.get_logger("relay.ops.outbox").bind(outbox=name)
        self._types = list(config.messages)
        self._horizon = 0
        self._duplicates_seen = 0
        self.commands = commands
        self.command_wake = command_wake
        self.identity = identity
        self.operations = Operations(store, source, self.mapper, publisher)
        self._commands_checked = 0.0
        self.metrics = metrics
        self._lag_measured = 0.0
        self._position = 0  # the checkpoint, as last written
        self._retry: RetryCount | None = None  # the head message's failures so far
        self._halted: str | None = None  # set: nothing moves until an operator's replay
        self.store = store
        # Destination templates, not rendered destinations, label the metric: bounded.
        self._published_to = {
            event_type: metrics.published.labels(name, rule.destination)
            for event_type, rule in config.messages.items()
        }
        metrics.register_outbox(name)

    async def run(self, session: Session) -> None:
        """Relay until `stop`, after the in-flight batch; driver errors become DatabaseError."""
        claim = session.checkpoint.claim
        self._horizon = self._position = session.position
        self._retry, self._halted = claim.retry, claim.halted
        self.metrics.halted.labels(self.name).set(0 if self._halted is None else 1)
        try:
            if claim.start_xmin is not None and not await self._settle_start(session):
                return
            await self._relay(session)
        except DB_ERRORS as exc:
            raise DatabaseError(f"lost the database connection: {exc}") from exc

    async def _settle_start(self, s: Session) -> bool:
        """`start: end`, first claim: start before the events of transactions open then.

        The checkpoint was put at the head; once every transaction that held a position
        then has ended, it moves back to just before the first event one of them wrote.
        False if stopped first.
        """
        horizon = await self.source.barrier(s.reader, self._blocked(s), self.stop)
        if horizon is None:
            return False
        claim = s.checkpoint.claim
        assert claim.start_xmin is not None
        first = await self.source.first_open_position(s.reader, claim.position, claim.start_xmin)
        start = claim.position if first is None else first - 1
        await s.checkpoint.settle_start(start)
        self._position = self._horizon = start
        self.state.set(checkpoint=start)
        self.log.info(
            "start: end: starting after the events committed before the first start",
            position=start,
            head_at_start=claim.position,
        )
        return True

    async def _relay(self, s: Session) -> None:
        position = self._position
        while not self.stop.is_set():
            position = await self._carry_out_commands(s, position)
            if self._halted is not None:
                await self._while_halted(s)
                continue
            batch = await self._next_batch(s, position)
            if batch is None:  # stopped, or just halted
                continue
            if batch.items and not await self._deliver(s, batch.items):
                if self.stop.is_set():
                    return
                self._horizon = position = self._position
                continue
            if batch.upto > position:
                await s.checkpoint.advance(batch.upto)
                position = self._position = batch.upto
                self.state.set(checkpoint=position, activity="relaying", attempts=0)
            if not batch.full:
                await self._idle()

    async def _carry_out_commands(self, s: Session, position: int) -> int:
        """Between batches: run operators' commands (NOTIFY wakes us; polling covers)."""
        now = time.monotonic()
        due = now - self._commands_checked >= self.source.config.poll_interval
        if not (self.command_wake.is_set() or due):
            return position
        self.command_wake.clear()
        self._commands_checked = now
        claim, writer = s.checkpoint.claim, s.checkpoint.writer
        while not self.stop.is_set():
            async with writer.statement() as conn:
                command = await self.commands.take(conn, claim, self.identity)
            if command is None:
                break
            log = self.log.bind(command=command.id, kind=command.kind, by=command.requested_by)
            log.info("carrying out command", args=command.args)
            ok, outcome = True, {}
            try:
                if command.kind == "replay":
                    outcome = await self.operations.replay(writer, claim, int(command.args["to"]))
                    position = self._position = int(command.args["to"])
                    self._horizon = min(self._horizon, position)
                    self._resume_if_halted()
                    self.state.set(checkpoint=position)
                else:
                    ids = command.args.get("ids")
                    outcome = await self.operations.retry_parked(writer, s.reader, claim, ids)
            except RelayError as exc:
                ok, outcome = False, {"error": str(exc)}
            async with writer.statement() as conn:
                await self.commands.finish(conn, command.id, ok, outcome)
            log.info("command done" if ok else "command failed", outcome=outcome)
        return position

    async def _next_batch(self, s: Session, position: int) -> Batch | None:
        """The next batch to publish; None if stopped or halted meanwhile."""
        if position >= self._horizon:
            self.wake.clear()
            started = time.monotonic()
            horizon = await self.source.barrier(s.reader, self._blocked(s), self.stop)
            if horizon is None:
                return None
            self.metrics.barrier_wait.labels(self.name).observe(time.monotonic() - started)
            if horizon < position:
                await self._halt(s, horizon, position)
                return None
            self._horizon = horizon
            await self._measure_lag(s, head=horizon)
        if self._horizon <= position:
            return Batch([], position, full=False)
        limit = self.config.batch.max_messages
        events = await self.source.read(
            s.reader,
            after=position,
            upto=self._horizon,
            limit=limit,
            aggregates=self.config.aggregates,
            types=self._types,
        )
        self.metrics.events_read.labels(self.name).inc(len(events))
        full = len(events) == limit
        upto = events[-1].position if full else self._horizon
        return Batch([self._item(e) for e in events], upto, full=full or upto < self._horizon)

    async def _halt(self, s: Session, head: int, position: int) -> None:
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
        await s.checkpoint.halt(self._halted)
        self.metrics.halted.labels(self.name).set(1)
        self.log.error("outbox halted", reason=self._halted, head=head, checkpoint=position)

    async def _while_halted(self, s: Session) -> None:
        """Hold the lease and carry out commands (the way out), publishing nothing."""
        self.state.set(activity="halted", last_error=self._halted)
        await wait_any(self.stop, self.command_wake, within=self.source.config.poll_interval)
        await self._measure_lag(s)

    def _resume_if_halted(self) -> None:
        if self._halted is not None:
            self._halted = None
            self.metrics.halted.labels(self.name).set(0)
            self.state.set(activity="relaying", last_error=None)
            self.log.info("outbox resumed by a replay")

    async def _measure_lag(self, s: Session, head: int | None = None) -> None:
        """Lag and parked gauges, by the database's clock, at most once a second.

        Called after each barrier, while retrying and while the barrier waits, so
        the gauges keep rising when the outbox is stuck.
        """
        now = time.monotonic()
        if now - self._lag_measured < 1.0:
            return
        self._lag_measured = now
        position = self._position
        if head is None:  # after a barrier the caller knows it; else ask
            head = await self.source.head(s.reader)
        behind = max(head - position, 0)
        self.metrics.lag_events.labels(self.name).set(behind)
        age = await self.source.pending_age(s.reader, position) if behind > 0 else 0.0
        self.metrics.lag_seconds.labels(self.name).set(age)
        async with s.checkpoint.writer.statement() as conn:
            parked = await self.store.parked_count(conn, self.name)
        self.metrics.parked.labels(self.name).set(parked)

    def _item(self, event: Event) -> Item:
        try:
            return Item(event, self.mapper.map(event), None)
        except MappingError as exc:
            return Item(event, None, exc)

    def _blocked(self, s: Session) -> Callable[[Blocker | None], Awaitable[None]]:
        async def report(blocker: Blocker | None) -> None:
            already = self.state.blocked_by
            if blocker is None:
                self.state.set(blocked_by=None, activity="relaying")
                self.log.info("barrier released")
            else:
                self.state.set(blocked_by=blocker.describe(), activity="waiting")
                if already is None or blocker.waited // 10 != (blocker.waited - 0.25) // 10:
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
            if (blocker is None) != (already is None) or already is None:
                await s.checkpoint.report_blocking(blocker)
            await self._measure_lag(s)

        return report

    async def _deliver(self, s: Session, items: list[Item]) -> bool:
        """Publish `items` in order; False if stopped or interrupted by an operator's command.

        The head message's failures are counted per position in `_retry`, which outlives
        this call: an operator's command or a replay interrupts the retrying, but does not
        start the count again, so `park_after` is reached whatever else happens.
        """
        backoff = Backoff(self.config.retry)
        pending = items
        while pending:
            sendable = []
            for item in pending:
                if item.message is None:
                    break
                sendable.append(item.message)
            outcomes = await self._publish(sendable) if sendable else []
            acked = next((i for i, o in enumerate(outcomes) if o is not None), len(outcomes))
            if acked:
                done, pending = pending[:acked], pending[acked:]
                self._acknowledged(done, self._failures_of(done[0]).attempts)
                self._retry = None
                if pending:
                    await s.checkpoint.advance(done[-1].event.position)
                    self._position = done[-1].event.position
            if not pending:
                break
            failure = _failure(outcomes, acked, pending[0])
            self.metrics.failures.labels(self.name, failure.reason).inc()
            before = self._failures_of(pending[0])
            count = self._retry = RetryCount(
                before.position, before.attempts + 1, before.rejections + failure.permanent
            )
            if failure.permanent and count.rejections >= self.config.park_after:
                await self._park(s, pending[0], failure, count.rejections)
                self._retry = None
                pending = pending[1:]
                continue
            await self._retrying(s, pending[0], failure, count)
            await wait_any(self.stop, self.command_wake, within=backoff.delay(count.attempts))
            if self.stop.is_set() or self.command_wake.is_set():
                # Nothing unacknowledged was checkpointed: the loop reads it again after
                # the operator's command (e.g. a replay) has been carried out.
                return False
        return True

    def _failures_of(self, head: Item) -> RetryCount:
        """The count so far for this message: kept only while it is still the one failing."""
        position = head.event.position
        if self._retry is not None and self._retry.position == position:
            return self._retry
        return RetryCount(position, 0, 0)

    async def _publish(self, messages: list[Message]) -> list[PublishError | None]:
        started = time.monotonic()
        outcomes = await self.publisher.publish(messages)
        if len(outcomes) != len(messages):  # an adapter bug must not lose or stall messages
            missing = TransientPublishError(
                f"broker {self.publisher.name!r} returned {len(outcomes)} outcomes"
                f" for {len(messages)} messages"
            )
            outcomes = [*outcomes[: len(messages)], *[missing] * (len(messages) - len(outcomes))]
        self.metrics.publish_duration.labels(self.name).observe(time.monotonic() - started)
        self.metrics.batch_messages.labels(self.name).observe(len(messages))
        return outcomes

    def _acknowledged(self, done: list[Item], attempt: int) -> None:
        duplicates = self.publisher.duplicates - self._duplicates_seen
        self._duplicates_seen = self.publisher.duplicates
        self.state.published += len(done)
        self.metrics.retrying.labels(self.name).set(0)
        db_now = time.time() + self.source.clock_offset
        latency = self.metrics.end_to_end.labels(self.name)
        for event_type, count in Counter(item.event.type for item in done).items():
            self._published_to[event_type].inc(count)
        for item in done:
            if item.event.created_at is not None:
                latency.observe(max(db_now - item.event.created_at.timestamp(), 0.0))
        self.log.debug(
            "batch acknowledged",
            first_position=done[0].event.position,
            last_position=done[-1].event.position,
            messages=len(done),
            duplicates=duplicates,
            attempt=attempt + 1,
        )

    async def _retrying(
        self, s: Session, head: Item, failure: PublishError, count: RetryCount
    ) -> None:
        self.state.set(activity="retrying", attempts=count.attempts, last_error=str(failure))
        self.metrics.retrying.labels(self.name).set(1)
        self.log.warning(
            "publish failed, retrying",
            position=head.event.position,
            attempt=count.attempts,
            reason=failure.reason,
            error=str(failure),
        )
        await s.checkpoint.report("retrying", str(failure), count)
        await self._measure_lag(s)

    async def _park(self, s: Session, item: Item, failure: PublishError, attempts: int) -> None:
        e = item.event
        await s.checkpoint.park(e, item.message, failure.reason, str(failure), attempts)
        self.state.parked += 1
        self.metrics.parked_total.labels(self.name, failure.reason).inc()
        self.metrics.parked.labels(self.name).inc()
        self.log.error(
            "message parked",
            position=e.position,
            aggregate=f"{e.aggregate_type}/{e.aggregate_id}@{e.version}",
            reason=failure.reason,
            error=str(failure),
            attempts=attempts,
        )

    async def _idle(self) -> None:
        """Wait for a NOTIFY or the poll interval, then linger to gather a batch."""
        interval = self.source.config.poll_interval
        self.state.set(activity="idle")
        await wait_any(self.stop, self.wake, self.command_wake, within=interval)
        self.state.set(activity="relaying")
        if self.config.batch.linger and not self.stop.is_set():
            await self._sleep(self.config.batch.linger)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True if the sleep ran its course."""
        return await sleep_unless(self.stop, seconds)


def _failure(outcomes: list[PublishError | None], index: int, head: Item) -> PublishError:
    """Why the head of the pending items failed: the broker's word, or the mapping's."""
    failure = outcomes[index] if index < len(outcomes) else head.error
    assert failure is not None
    return failure
